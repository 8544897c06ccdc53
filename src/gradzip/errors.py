"""The one error type gradzip raises for bad input: it names the problem and the fix."""


class GradzipError(ValueError):
    """Invalid configuration or input (a bad spec string, hyper-parameter, dataset, flag).

    Subclasses ``ValueError`` so callers that already catch ``ValueError`` keep working.
    The message is one readable sentence that says what is wrong and what is valid.
    """


def first_line(exc: BaseException, last: bool = False, limit: int = 200) -> str:
    """One line of ``exc``'s message for a one-line error: its first (or ``last``) non-empty
    line, at most ``limit`` characters; the exception's type name when it has no text (an
    ``EOFError()`` from an empty file)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1 if last else 0] if lines else type(exc).__name__)[:limit]
