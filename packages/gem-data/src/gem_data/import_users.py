"""How an import keys users, the same in every window of a data set (``--append``): integer ids
as they are, text as the ``hash`` string id of the text; an appended window must read its users
the way the data set's first window did (:mod:`gem_data.import_append`). Both engines decide by
these rules: :func:`user_keys` on a log in memory (numpy), :func:`users_as_text` on the kinds
the DuckDB engine staged."""

from __future__ import annotations

from typing import Any

import numpy as np

from gem_data.import_log import Log


def user_keys(log: Log, column: str, as_text: bool | None) -> np.ndarray:
    """The user column of ``log`` as :meth:`Log.keys` reads it (integers, or text when not every
    value is one). ``as_text``: how the data set appended to reads its users (None: not
    appending): True keeps the text of a column whose values all look like integers, as one
    import of all the logs would; False refuses text."""
    cells = log.key_column(column, "user")
    if as_text is None or as_text == (cells.numbers is None):
        return cells.values
    if as_text:
        if cells.texts is None:
            log.fail(None, column, f"the user ids are integers ({log.table.column(column).type}), "
                                   "but the data set's are text: write them as text, as the "
                                   "earlier windows' logs do")
        return cells.texts
    # The first text that is no 64-bit integer (None: the column mixes negative ids and ids of
    # 2^63 and more, which no one integer type holds).
    row = next((i for i, text in enumerate(cells.texts) if not _is_integer(text)), None)
    user = f"user {str(cells.texts[row])!r} is text" if row is not None else "the users are text"
    log.fail(row, column, f"{user}, but the data set's user ids are integers: one import of all "
                          "the logs would number every user by the hash of its text, so this "
                          "window cannot follow the earlier ones (import all the logs again, "
                          "into a new data set)")
    raise AssertionError("Log.fail raises")


def _is_integer(text: str) -> bool:
    try:
        return -(1 << 63) <= int(text.strip()) < (1 << 64)
    except ValueError:
        return False


def users_as_text(staged: Any, as_text: bool | None, column: str) -> bool:
    """Whether the DuckDB engine keys users by text: :func:`user_keys`'s rule over the staged
    logs' kinds of user column (:class:`~gem_data.import_stage.KeyKind`)."""
    kinds = [(log, staged.kinds[f"u_{name}"]) for log, name in
             ((staged.imp_log, "impressions"), (staged.ev_log, "events"))
             if f"u_{name}" in staged.kinds]
    text = not kinds[0][1].numbers
    if as_text is None or as_text == text:
        return text
    if as_text:
        for log, kind in kinds:
            if not kind.from_text:
                log.fail(None, column, "the user ids are integers, but the data set's are "
                                       "text: write them as text, as the earlier windows' "
                                       "logs do")
        return True
    log = next(log for log, kind in kinds if not kind.numbers)
    log.fail(None, column, "the user ids are text, but the data set's user ids are integers: "
                           "one import of all the logs would number every user by the hash "
                           "of its text, so this window cannot follow the earlier ones "
                           "(import all the logs again, into a new data set)")
    raise AssertionError("Log.fail raises")
