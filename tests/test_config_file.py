"""--config FILE (gradzip.train.config_file): every flag from a TOML file, the command line
over it, the effective settings written into --out, and that file repeating the run."""
import json

import pytest

from gradzip import cli
from gradzip.train import config_file


def _settings(args):
    return {k: v for k, v in vars(args).items() if k != "config"}


@pytest.mark.parametrize("argv", [
    ["train", "--algo", "efsgd", "--compressor", "topk:ratio=0.1", "--nesterov", "--momentum", "0.5",
     "--workers", "3", "--backend", "threads", "--bandwidth", "10mbit", "--workers-at", "2,8", "--timeout", "12.5",
     "--nonfinite", "skip", "--eval-on", "local", "--seed", "7", "--lr", "1e-05", "--no-plot", "--out", "o"],
    ["compare", "--algos", "ssgd,powersgd", "--rank", "2", "--use-error-feedback", "false", "--epochs", "3",
     "--checkpoint-dir", "ck", "--checkpoint-every", "5", "--trace", "t.json", "--quiet"],
])
def test_the_written_settings_parse_back_to_the_same_arguments(tmp_path, argv):
    args = cli.parse_args(argv)
    path = config_file.write(tmp_path / "config.toml", config_file.effective(cli.build_parser().commands[argv[0]], args))
    again = cli.parse_args([argv[0], "--config", str(path)])
    assert _settings(again) == _settings(args)


def test_every_flag_of_train_and_compare_is_a_setting():
    parser = cli.build_parser()
    for command in ("train", "compare"):
        flags = {o for a in parser.commands[command]._actions for o in a.option_strings if o.startswith("--")}
        keys = set(config_file._settings(parser.commands[command]))
        assert {f[2:] for f in flags} - keys == {"help", "config"}


def test_the_command_line_overrides_the_file_and_lists_may_be_arrays(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('algos = ["ssgd", "efsgd@topk:ratio=0.1"]\nepochs = 2\nlr = 0.05\nnesterov = true\n'
                    'bandwidth = ["1gbit", "10gbit"]\nworkers-at = [4, 16]\n')
    args = cli.parse_args(["compare", "--config", str(path), "--lr", "0.2"])
    assert (args.algos, args.epochs, args.lr, args.nesterov) == ("ssgd,efsgd@topk:ratio=0.1", 2, 0.2, True)
    assert (args.bandwidth, args.workers_at) == ("1gbit,10gbit", "4,16")


@pytest.mark.parametrize("text, message", [
    ("lr = -1\n", "lr = -1: expected a number >= 0"),
    ("nonfinite = \"maybe\"\n", "nonfinite = 'maybe': expected one of raise, skip, off"),
    ("nesterov = \"yes\"\n", "nesterov = 'yes': expected true or false"),
    ("batch_size = 3\n", "has no setting batch_size; a key is a flag without its dashes"),
    ("epochs = \n", "not valid TOML"),
    ("command = \"compare\"\n", "was written for gradzip compare, not train"),
    ("dataset = {a = 1}\n", "expected a string"),
])
def test_a_bad_file_is_one_line_naming_the_file_and_key(tmp_path, text, message, capsys):
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert cli.main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err and len(err.strip().splitlines()) == 1


def test_a_missing_file_is_one_line(tmp_path, capsys):
    assert cli.main(["train", "--config", str(tmp_path / "none.toml")]) == 2
    assert "cannot read it" in capsys.readouterr().err


def test_the_config_written_into_out_repeats_the_run_exactly(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    assert cli.main(["compare", "--algos", "ssgd,efsgd@topk:ratio=0.1", "--workers", "2", "--backend", "threads",
                     "--epochs", "1", "--batch-size", "16", "--lr", "0.05", "--seed", "3", "--quiet", "--no-plot",
                     "--bandwidth", "none", "--out", str(first)]) == 0
    assert cli.main(["compare", "--config", str(first / "config.toml"), "--out", str(second)]) == 0
    a, b = (json.loads((d / "summary.json").read_text()) for d in (first, second))
    keys = ["algo", "workers", "steps", "lr", "seed", "batch_size_per_worker", "final_test_accuracy",
            "bytes_sent_per_worker"]
    assert [[s[k] for k in keys] for s in a] == [[s[k] for k in keys] for s in b]
    losses = [[json.loads(line)["train_loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]
              for d in (first, second)]
    assert losses[0] == losses[1]
    written = [(d / "config.toml").read_text().splitlines() for d in (first, second)]
    assert [l for l in written[0] if not l.startswith(("#", "out ="))] == \
        [l for l in written[1] if not l.startswith(("#", "out ="))]
