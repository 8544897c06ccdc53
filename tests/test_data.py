"""Datasets: digits, synthetic, shard(), IDX / CIFAR-10 parsing, checksums, downloads."""

import gzip
import hashlib
import io
import pickle
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.errors import GradzipError
from datafiles import idx_bytes, mnist_arrays, mnist_file_bytes, write_files
from gradzip.train import datasets as data
from gradzip.train.datasets import generated, registry

MNIST_5K = Path(__file__).parents[2] / "shared/data/mnist-5k"
MNIST_NAMES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte",
               "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]


# ----------------------------------------------------------------------------- helpers




def expected_normalized(train_u8, test_u8):
    tr = torch.from_numpy(train_u8.astype(np.float32) / 255).unsqueeze(1)
    te = torch.from_numpy(test_u8.astype(np.float32) / 255).unsqueeze(1)
    std, mean = torch.std_mean(tr)
    return (tr - mean) / std, (te - mean) / std


def cifar_batch(n, seed, protocol=2, str_keys=False) -> bytes:
    rng = np.random.default_rng(seed)
    batch = {b"batch_label": b"testing batch",
             b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
             b"labels": [int(v) for v in rng.integers(0, 10, n)]}
    if str_keys:
        batch = {k.decode(): v for k, v in batch.items()}
    raw = pickle.dumps(batch, protocol=protocol)
    if protocol == 2:  # the real files name numpy < 2's module, as numpy.core.multiarray
        raw = raw.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
    return raw


def cifar_files(n=4) -> dict:
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    return {name: cifar_batch(n, seed=i, protocol=2 + i % 4, str_keys=i == 3)
            for i, name in enumerate(names)}


def cifar_tar(files: dict) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


class FakeServer:
    """Stands in for urllib.request.urlopen: serves bytes by URL, records requests."""

    def __init__(self, files: dict, fail_prefixes=()):
        self.files, self.fail_prefixes, self.requests = files, fail_prefixes, []

    def __call__(self, url, timeout=None):
        self.requests.append(url)
        if any(url.startswith(p) for p in self.fail_prefixes) or url not in self.files:
            raise urllib.error.URLError("Temporary failure in name resolution")
        return io.BytesIO(self.files[url])


# ----------------------------------------------------------------------------- names, errors


def test_names():
    assert data.names() == ["digits", "synthetic", "mnist", "fashion-mnist", "cifar10", "modadd", "text"]


def test_unknown_name_lists_valid_names():
    with pytest.raises(GradzipError, match="unknown dataset 'imagenet'") as e:
        data.load("imagenet")
    for name in data.names():
        assert name in str(e.value)


def test_options_on_a_dataset_without_options():
    with pytest.raises(GradzipError, match="takes no options"):
        data.load("digits:n=5")


@pytest.mark.parametrize("name", ["mnist", "fashion-mnist", "cifar10"])
def test_file_dataset_needs_data_dir(name):
    with pytest.raises(GradzipError, match="pass a data directory"):
        data.load(name)


def test_missing_dir_without_download(tmp_path):
    with pytest.raises(GradzipError, match="does not exist"):
        data.load("mnist", tmp_path / "nope", download=False)


# ----------------------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digits():
    return data.load("digits")


def test_digits_shapes_and_classes(digits):
    assert digits.name == "digits"
    assert digits.train_x.shape == (1437, 1, 8, 8) and digits.test_x.shape == (360, 1, 8, 8)
    assert digits.input_shape == (1, 8, 8)
    assert digits.num_classes == 10
    assert digits.train_x.dtype == torch.float32 and digits.train_y.dtype == torch.int64
    assert digits.test_y.dtype == torch.int64
    # stratified: every class in both splits, in proportion
    test_counts = torch.bincount(digits.test_y, minlength=10).double()
    total = test_counts + torch.bincount(digits.train_y, minlength=10)
    assert ((test_counts / total - 0.2).abs() < 0.01).all()
    assert "train=1437" in repr(digits)


def test_digits_normalized_with_train_statistics(digits):
    assert abs(digits.train_x.mean().item()) < 1e-5
    assert abs(digits.train_x.std().item() - 1) < 1e-4
    assert abs(digits.test_x.mean().item()) < 0.1  # test uses train stats: close, not exact


def test_digits_deterministic_and_independent_of_seed(digits):
    other = data.load("digits")  # load takes no run seed (it had one, ignored)
    for a, b in [(digits.train_x, other.train_x), (digits.train_y, other.train_y),
                 (digits.test_x, other.test_x), (digits.test_y, other.test_y)]:
        assert torch.equal(a, b)


def test_digits_split_is_scikit_learns():
    """The split gradzip computes itself (scikit-learn is no longer imported to load the
    digits) is the one ``train_test_split(stratify=y, random_state=0)`` gives, order
    included: on the digits' labels and on label sets whose shares tie."""
    from sklearn.model_selection import train_test_split
    from gradzip.train.datasets import digits as digits_module

    with gzip.open(digits_module._data_file(), "rt") as f:
        y_digits = np.loadtxt(f, delimiter=",")[:, -1].astype(np.int64)
    rng = np.random.RandomState(5)
    for y, n_test, seed in [(y_digits, 360, 0), (rng.randint(0, 7, 203), 41, 3),
                            (np.repeat(np.arange(4), [5, 5, 5, 6]), 7, 1), (np.array([2, 0, 1, 2, 1, 0, 0, 1]), 3, 9)]:
        index = np.arange(len(y))
        want_train, want_test = train_test_split(index, test_size=n_test, stratify=y, random_state=seed)
        train, test = digits_module.stratified_split(y, n_test, seed)
        assert np.array_equal(train, want_train) and np.array_equal(test, want_test)


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_spec():
    d = data.load("synthetic:n=300,test=60,shape=3x32x32,classes=5")
    assert d.train_x.shape == (300, 3, 32, 32) and d.test_x.shape == (60, 3, 32, 32)
    assert d.num_classes == 5 and d.input_shape == (3, 32, 32)
    assert d.name == "synthetic:n=300,test=60,shape=3x32x32,classes=5,seed=0"
    assert d.train_y.dtype == torch.int64 and set(d.train_y.tolist()) == set(range(5))
    assert torch.bincount(d.train_y).min() >= 30  # roughly balanced
    assert d.train_x.mean(dim=(0, 2, 3)).abs().max() < 1e-5


def test_synthetic_default_and_flat():
    d = data.synthetic(n=64, test=16)
    assert d.input_shape == (1, 28, 28) and d.num_classes == 10
    flat = data.load("synthetic:n=64,test=16,shape=784")
    assert flat.input_shape == (784,) and flat.train_x.shape == (64, 784)


def test_synthetic_defaults_match_docs():
    assert generated._SYNTH_DEFAULTS == {"n": 8192, "test": 2048, "shape": (1, 28, 28),
                                         "classes": 10, "seed": 0}


def test_synthetic_deterministic_seeded_and_test_set_fixed():
    a = data.load("synthetic:n=128,test=32,shape=1x8x8")
    b = data.load("synthetic:n=128,test=32,shape=1x8x8")
    c = data.load("synthetic:n=128,test=32,shape=1x8x8,seed=1")
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.train_y, b.train_y)
    assert not torch.equal(a.train_x, c.train_x)
    bigger = data.load("synthetic:n=256,test=32,shape=1x8x8")
    assert torch.equal(a.test_y, bigger.test_y)  # the test set does not depend on n


def test_synthetic_is_learnable():
    d = data.load("synthetic:n=2048,test=512,shape=64,classes=4")
    x = torch.cat([d.train_x, torch.ones(len(d.train_x), 1)], 1)
    w = torch.linalg.lstsq(x, torch.nn.functional.one_hot(d.train_y, 4).float()).solution
    xt = torch.cat([d.test_x, torch.ones(len(d.test_x), 1)], 1)
    assert ((xt @ w).argmax(1) == d.test_y).float().mean() > 0.6  # chance is 0.25


@pytest.mark.parametrize("spec, match", [
    ("synthetic:n=0", "n must be an integer >= 1"),
    ("synthetic:classes=1", "classes must be"),
    ("synthetic:shape=3x32", "shape must be"),
    ("synthetic:n=abc", "needs an integer"),
    ("synthetic:size=5", "bad synthetic option"),
])
def test_synthetic_bad_options(spec, match):
    with pytest.raises(GradzipError, match=match):
        data.load(spec)


def test_synthetic_too_large_to_generate_is_one_line(monkeypatch):
    """Issue 35 item 12: 10^10 features per sample (800 TB to generate) was a raw allocation
    traceback; now one line naming the size, the memory available and the fix, before
    anything is allocated (also for a size that would fit a larger machine)."""
    with pytest.raises(GradzipError, match=r"1x100000x100000 .* need about [\d,]+ GB of memory .* smaller shape"):
        data.load("synthetic:shape=1x100000x100000")
    from gradzip.train.datasets import generated
    monkeypatch.setattr(generated, "_available_bytes", lambda: 10**6)
    with pytest.raises(GradzipError, match=r"need about 0.00924 GB .* the 0.001 GB available") as error:
        data.load("synthetic:n=300,test=60,shape=3x32x32")
    assert "\n" not in str(error.value)
    monkeypatch.setattr(generated, "_available_bytes", lambda: None)   # unknown: not refused
    assert len(data.load("synthetic:n=30,test=6,shape=3x8x8").train_x) == 30


# ----------------------------------------------------------------------------- shard


def test_shard_partitions_an_epoch():
    n, w = 103, 4
    shards = [data.shard(n, r, w, epoch=0, seed=0) for r in range(w)]
    assert all(s.dtype == torch.int64 and len(s) == n // w for s in shards)
    both = torch.cat(shards)
    assert len(set(both.tolist())) == len(both) == n - n % w  # disjoint, all but < w
    assert both.min() >= 0 and both.max() < n


def test_shard_identical_across_calls_changes_with_epoch_and_seed():
    a = data.shard(1000, 1, 3, epoch=2, seed=5)
    assert torch.equal(a, data.shard(1000, 1, 3, epoch=2, seed=5))
    assert not torch.equal(a, data.shard(1000, 1, 3, epoch=3, seed=5))
    assert not torch.equal(a, data.shard(1000, 1, 3, epoch=2, seed=6))


def test_shard_is_round_robin_over_one_permutation():
    full = data.shard(50, 0, 1, epoch=1, seed=3)
    assert sorted(full.tolist()) == list(range(50))
    for r in range(5):
        assert torch.equal(data.shard(50, r, 5, epoch=1, seed=3), full[r::5])


def test_shard_does_not_touch_global_rng():
    state = torch.get_rng_state()
    data.shard(100, 0, 2, 0, 0)
    assert torch.equal(state, torch.get_rng_state())


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 500), w=st.integers(1, 9), epoch=st.integers(0, 100))
def test_shard_property(n, w, epoch):
    if n < w:
        with pytest.raises(GradzipError):
            data.shard(n, 0, w, epoch, 0)
        return
    shards = [data.shard(n, r, w, epoch, 0) for r in range(w)]
    flat = torch.cat(shards).tolist()
    assert len(flat) == len(set(flat)) == n - n % w


@pytest.mark.parametrize("args, match", [
    ((10, 2, 2, 0, 0), "rank must be in"),
    ((10, 0, 0, 0, 0), "world_size must be"),
    ((10, 0, 1, -1, 0), "epoch must be"),
    ((10, 0, 1, 0.5, 0), "integer epoch"),
])
def test_shard_bad_arguments(args, match):
    with pytest.raises(GradzipError, match=match):
        data.shard(*args)


# ----------------------------------------------------------------------------- IDX files


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_from_idx_files(tmp_path, gz):
    arrays = mnist_arrays()
    write_files(tmp_path, mnist_file_bytes(arrays, gz=gz))
    d = data.load("mnist", tmp_path, download=False)
    assert d.name == "mnist" and d.num_classes == 10 and d.input_shape == (1, 28, 28)
    assert d.train_x.shape == (12, 1, 28, 28) and d.test_x.shape == (5, 1, 28, 28)
    assert d.train_y.tolist() == arrays["train-labels-idx1-ubyte"].tolist()
    assert d.test_y.dtype == torch.int64
    tr, te = expected_normalized(arrays["train-images-idx3-ubyte"],
                                 arrays["t10k-images-idx3-ubyte"])
    torch.testing.assert_close(d.train_x, tr)
    torch.testing.assert_close(d.test_x, te)


def test_fashion_mnist_from_its_subdirectory(tmp_path):
    write_files(tmp_path / "mnist", mnist_file_bytes(mnist_arrays(seed=1)))
    write_files(tmp_path / "fashion-mnist", mnist_file_bytes(mnist_arrays(n_train=7, seed=2)))
    assert len(data.load("fashion-mnist", tmp_path, download=False).train_y) == 7
    assert len(data.load("mnist", tmp_path, download=False).train_y) == 12


def test_read_idx(tmp_path):
    a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    p = tmp_path / "x-idx3-ubyte"
    p.write_bytes(idx_bytes(2051, a.shape, a.tobytes()))
    np.testing.assert_array_equal(data.read_idx(p, 2051), a)
    with pytest.raises(GradzipError, match="magic number 2051, expected 2049"):
        data.read_idx(p, 2049)


def test_wrong_magic_names_the_file(tmp_path):
    files = mnist_file_bytes(mnist_arrays())
    a = mnist_arrays()["train-labels-idx1-ubyte"]
    files["train-labels-idx1-ubyte.gz"] = gzip.compress(idx_bytes(2051, a.shape, a.tobytes()))
    write_files(tmp_path, files)
    with pytest.raises(GradzipError, match=r"train-labels-idx1-ubyte\.gz has magic number"):
        data.load("mnist", tmp_path, download=False)


def test_truncated_gzip_names_the_file(tmp_path):
    files = mnist_file_bytes(mnist_arrays())
    files["t10k-images-idx3-ubyte.gz"] = files["t10k-images-idx3-ubyte.gz"][:200]
    write_files(tmp_path, files)
    with pytest.raises(GradzipError, match=r"t10k-images-idx3-ubyte\.gz is a corrupt or "
                                           r"truncated gzip"):
        data.load("mnist", tmp_path, download=False)


def test_not_gzip_data_in_a_gz_file(tmp_path):
    files = mnist_file_bytes(mnist_arrays())
    files["t10k-labels-idx1-ubyte.gz"] = b"<html>Not Found</html>"
    write_files(tmp_path, files)
    with pytest.raises(GradzipError, match=r"t10k-labels-idx1-ubyte\.gz is not a gzip file"):
        data.load("mnist", tmp_path, download=False)


def test_truncated_payload_names_the_file(tmp_path):
    files = mnist_file_bytes(mnist_arrays(), gz=False)
    files["train-images-idx3-ubyte"] = files["train-images-idx3-ubyte"][:-10]
    write_files(tmp_path, files)
    with pytest.raises(GradzipError, match=r"train-images-idx3-ubyte is truncated"):
        data.load("mnist", tmp_path, download=False)


def test_mismatched_counts(tmp_path):
    arrays = mnist_arrays()
    arrays["train-labels-idx1-ubyte"] = arrays["train-labels-idx1-ubyte"][:-1]
    write_files(tmp_path, mnist_file_bytes(arrays))
    with pytest.raises(GradzipError, match="holds 12 images but .* holds 11 labels"):
        data.load("mnist", tmp_path, download=False)


def test_mnist_files_refused_as_fashion_mnist(tmp_path, monkeypatch):
    files = mnist_file_bytes(mnist_arrays())
    name = "train-labels-idx1-ubyte.gz"
    monkeypatch.setitem(data.MD5["mnist"], name, hashlib.md5(files[name]).hexdigest())
    write_files(tmp_path / "fashion-mnist", files)
    with pytest.raises(GradzipError, match="is the mnist file, not fashion-mnist"):
        data.load("fashion-mnist", tmp_path, download=False)


def test_missing_files_without_download(tmp_path):
    with pytest.raises(GradzipError, match="not found in .*train-images-idx3-ubyte.gz"):
        data.load("mnist", tmp_path, download=False)


def test_sha256sums_good_and_bad(tmp_path):
    files = mnist_file_bytes(mnist_arrays())
    sums = "".join(f"{hashlib.sha256(c).hexdigest()}  {n}\n" for n, c in files.items())
    write_files(tmp_path, files)
    (tmp_path / "SHA256SUMS").write_text(sums)
    assert len(data.load("mnist", tmp_path, download=False).train_y) == 12
    (tmp_path / "SHA256SUMS").write_text(sums.replace(sums[:8], "00000000", 1))
    with pytest.raises(GradzipError, match="does not match its checksum"):
        data.load("mnist", tmp_path, download=False)
    (tmp_path / "SHA256SUMS").write_text("garbage\n")
    with pytest.raises(GradzipError, match="SHA256SUMS line 1"):
        data.load("mnist", tmp_path, download=False)


def test_real_mnist_5k():
    if not MNIST_5K.is_dir():
        pytest.skip(f"shared MNIST subset not present at {MNIST_5K}")
    d = data.load("mnist", MNIST_5K, download=False)  # also verifies its SHA256SUMS
    assert d.train_x.shape == (4000, 1, 28, 28) and d.test_x.shape == (1000, 1, 28, 28)
    assert d.num_classes == 10
    assert torch.bincount(d.train_y).tolist() == [400] * 10
    assert torch.bincount(d.test_y).tolist() == [100] * 10


# ----------------------------------------------------------------------------- CIFAR-10


def check_cifar(d, n=4):
    assert d.name == "cifar10" and d.num_classes == 10 and d.input_shape == (3, 32, 32)
    assert d.train_x.shape == (5 * n, 3, 32, 32) and d.test_x.shape == (n, 3, 32, 32)
    assert d.train_y.dtype == torch.int64
    assert d.train_x.mean(dim=(0, 2, 3)).abs().max() < 1e-5


def test_cifar10_from_batches_dir(tmp_path):
    files = cifar_files()
    write_files(tmp_path / "cifar-10-batches-py", files)
    d = data.load("cifar10", tmp_path, download=False)
    check_cifar(d)
    first = pickle.loads(files["data_batch_1"], encoding="bytes")
    assert d.train_y[:4].tolist() == first[b"labels"]
    raw = torch.from_numpy(first[b"data"].reshape(4, 3, 32, 32).astype(np.float32) / 255)
    # normalization is a per-channel affine map of the raw pixels, in the same order
    pairs = torch.stack([raw[:, 0].flatten(), d.train_x[:4, 0].flatten()])
    assert torch.corrcoef(pairs)[0, 1] > 0.9999


def test_cifar10_from_tarball(tmp_path):
    (tmp_path / "cifar10").mkdir()
    (tmp_path / "cifar10" / "cifar-10-python.tar.gz").write_bytes(cifar_tar(cifar_files()))
    check_cifar(data.load("cifar10", tmp_path, download=False))


def test_cifar10_refuses_unsafe_pickle(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    files = cifar_files()
    files["test_batch"] = pickle.dumps({b"data": Evil(), b"labels": []})
    write_files(tmp_path / "cifar-10-batches-py", files)
    with pytest.raises(GradzipError, match=r"test_batch is not a CIFAR-10 batch .*builtins.print"):
        data.load("cifar10", tmp_path, download=False)


def test_cifar10_truncated_tarball(tmp_path):
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(cifar_tar(cifar_files())[:500])
    with pytest.raises(GradzipError, match="cifar-10-python.tar.gz is a corrupt or truncated"):
        data.load("cifar10", tmp_path, download=False)


# ----------------------------------------------------------------------------- downloads


@pytest.fixture
def mnist_server(monkeypatch):
    files = mnist_file_bytes(mnist_arrays())
    for name, content in files.items():
        monkeypatch.setitem(data.MD5["mnist"], name, hashlib.md5(content).hexdigest())
    server = FakeServer({data.MIRRORS["mnist"][0] + n: c for n, c in files.items()})
    monkeypatch.setattr(urllib.request, "urlopen", server)
    return server, files


def test_download_mnist(tmp_path, mnist_server):
    server, files = mnist_server
    d = data.load("mnist", tmp_path)
    assert len(d.train_y) == 12
    assert sorted(server.requests) == sorted(data.MIRRORS["mnist"][0] + n for n in files)
    for name, content in files.items():
        assert (tmp_path / "mnist" / name).read_bytes() == content
    assert not list((tmp_path / "mnist").glob("*.part"))
    server.requests.clear()
    data.load("mnist", tmp_path)  # second load: from disk
    assert server.requests == []


def test_download_only_missing_files(tmp_path, mnist_server):
    server, files = mnist_server
    write_files(tmp_path / "mnist", {"train-images-idx3-ubyte.gz":
                                     files["train-images-idx3-ubyte.gz"]})
    data.load("mnist", tmp_path)
    assert len(server.requests) == 3
    assert not any("train-images" in url for url in server.requests)


def test_download_falls_back_to_the_next_mirror(tmp_path, mnist_server):
    server, files = mnist_server
    server.files = {data.MIRRORS["mnist"][1] + n: c for n, c in files.items()}
    data.load("mnist", tmp_path)
    assert any(u.startswith(data.MIRRORS["mnist"][0]) for u in server.requests)
    assert (tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz").is_file()


def test_download_bad_checksum(tmp_path, mnist_server, monkeypatch):
    monkeypatch.setitem(data.MD5["mnist"], "train-labels-idx1-ubyte.gz", "0" * 32)
    with pytest.raises(GradzipError, match="train-labels-idx1-ubyte.gz has the wrong checksum"):
        data.load("mnist", tmp_path)
    assert not (tmp_path / "mnist" / "train-labels-idx1-ubyte.gz").exists()
    assert not list((tmp_path / "mnist").glob("*.part"))


def test_download_network_failure(tmp_path, monkeypatch):
    server = FakeServer({})
    monkeypatch.setattr(urllib.request, "urlopen", server)
    with pytest.raises(GradzipError) as e:
        data.load("fashion-mnist", tmp_path)
    msg = str(e.value)
    assert f"not found in {tmp_path / 'fashion-mnist'}" in msg
    assert "could not be downloaded" in msg
    for stem in MNIST_NAMES:
        assert stem + ".gz" in msg
    assert server.requests[0] == data.MIRRORS["fashion-mnist"][0] + "train-images-idx3-ubyte.gz"


def test_download_cifar10(tmp_path, monkeypatch):
    tarball = cifar_tar(cifar_files())
    monkeypatch.setitem(data.MD5["cifar10"], "cifar-10-python.tar.gz",
                        hashlib.md5(tarball).hexdigest())
    url = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
    monkeypatch.setattr(urllib.request, "urlopen", FakeServer({url: tarball}))
    check_cifar(data.load("cifar10", tmp_path))
    assert (tmp_path / "cifar10" / "cifar-10-python.tar.gz").read_bytes() == tarball


def test_download_cifar10_bad_checksum(tmp_path, monkeypatch):
    url = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
    monkeypatch.setattr(urllib.request, "urlopen", FakeServer({url: b"not the archive"}))
    with pytest.raises(GradzipError, match="wrong checksum"):
        data.load("cifar10", tmp_path)


def test_checksum_table_is_the_standard_one():
    assert data.MD5["mnist"]["train-images-idx3-ubyte.gz"] == "f68b3c2dcbeaaa9fbdd348bbdeb94873"
    assert data.MD5["fashion-mnist"]["t10k-labels-idx1-ubyte.gz"] == \
        "bb300cfdad3c16e7a12a480ee83cd310"
    assert data.MD5["cifar10"]["cifar-10-python.tar.gz"] == "c58f30108f718f92721af3b95e74349a"
    assert data.MIRRORS["mnist"][0] == "https://ossci-datasets.s3.amazonaws.com/mnist/"
    assert data.MIRRORS["fashion-mnist"][0] == \
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"


def test_load_takes_no_run_seed():
    """``load(seed=)`` was accepted and ignored: a seed that changes nothing is refused."""
    with pytest.raises(TypeError):
        data.load("digits", seed=123)


def test_register_adds_a_loadable_dataset(tmp_path):
    """``datasets.register`` is public, like ``compressors.register``: a registered loader is
    listed and loaded (with its options, or from its data directory), aliases resolve, and
    a name is refused twice."""
    tiny = data.Dataset("tiny", torch.zeros(4, 2), torch.tensor([0, 1, 0, 1]),
                        torch.zeros(2, 2), torch.tensor([0, 1]), 2)
    got = []

    @data.register("tinytest", options=True, aliases=("tiny_test",))
    def _tiny(options):
        got.append([(o.key, o.value) for o in options])
        return tiny

    @data.register("tinyfiles", files=True)
    def _files(root, download):
        got.append((root, download))
        return tiny

    try:
        assert {"tinytest", "tinyfiles"} <= set(data.names())
        assert data.load("tiny_test:n=3") is tiny
        assert data.load("tinyfiles", tmp_path, download=False) is tiny
        assert got[0] == [("n", "3")]
        assert Path(got[1][0]) == tmp_path and got[1][1] is False
        with pytest.raises(GradzipError, match="registered twice"):
            data.register("tinytest")(_tiny)
        with pytest.raises(GradzipError, match="registered twice"):
            data.register("other", aliases=("tiny_test",))
        with pytest.raises(GradzipError, match="lower-case name"):
            data.register("Tiny")
    finally:
        for name in ("tinytest", "tinyfiles"):
            registry._REGISTRY.pop(name, None)
        registry._ALIASES.pop("tiny_test", None)
