"""Scripts that measure gradzip and write the results into docs/ (not installed with the
package; the package never reads a file from here).

Run them from the checkout root as modules, ``python -m benchmarks.NAME ...``: as a
package they share :mod:`benchmarks.docs_section` (the one section writer) and
:mod:`benchmarks.faults` (fault injection, also used by the tests) by plain imports,
without editing ``sys.path``.
"""
