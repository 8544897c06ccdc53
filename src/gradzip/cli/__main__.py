"""``python -m gradzip.cli`` (as ``gradzip``)."""
from . import run

run()
