"""The one error type gradzip raises for bad input: it names the problem and the fix."""


class GradzipError(ValueError):
    """Invalid configuration or input (a bad spec string, hyper-parameter, dataset, flag).

    Subclasses ``ValueError`` so callers that already catch ``ValueError`` keep working.
    The message is one readable sentence that says what is wrong and what is valid.
    """
