"""Results rows as text: CSV (full precision) and GitHub-flavoured Markdown (readable).

Markdown is written here rather than with `DataFrame.to_markdown`, which needs
the optional `tabulate` package.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["format_cell", "to_csv", "to_markdown"]


def to_csv(df) -> str:
    """CSV with a header row; floats at full precision, timestamps as ISO strings."""
    import pandas as pd

    out = df.copy()
    for c in out.columns:
        if pd.api.types.is_datetime64_any_dtype(out[c]):
            out[c] = out[c].map(lambda t: t.isoformat() if not pd.isna(t) else "")
    return out.to_csv(index=False)


def format_cell(v, float_fmt: str = ".6g") -> str:
    """One cell for a human: floats to 6 significant digits, NaN/None as empty, no pipes or newlines."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    if hasattr(v, "isoformat"):  # datetime / pandas Timestamp
        text = v.isoformat()
    elif isinstance(v, numbers.Integral) and not isinstance(v, bool):
        text = str(int(v))
    elif isinstance(v, numbers.Real) and not isinstance(v, bool):
        text = format(float(v), float_fmt)
    else:
        try:
            import pandas as pd

            if pd.isna(v):
                return ""
        except (TypeError, ValueError):
            pass
        text = str(v)
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def to_markdown(df, float_fmt: str = ".6g") -> str:
    """A Markdown table (numeric columns right-aligned); an empty frame still gets its header."""
    import pandas as pd

    cols = [str(c) for c in df.columns]
    numeric = [pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c]) for c in df.columns]
    lines = ["| " + " | ".join(format_cell(c) for c in cols) + " |",
             "|" + "|".join("---:" if n else ":---" for n in numeric) + "|"]
    for row in df.itertuples(index=False, name=None):
        lines.append("| " + " | ".join(format_cell(v, float_fmt) for v in row) + " |")
    return "\n".join(lines) + "\n"
