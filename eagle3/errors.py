"""User-facing errors.

:class:`Eagle3Error` carries one sentence that says what is wrong and what to change.
Entry points print it without a traceback and exit non-zero (:func:`eagle3.cli.run_stage`).
"""


class Eagle3Error(Exception):
    """A problem with the user's input or environment that the user can fix."""
