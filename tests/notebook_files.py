"""Small notebooks written for the lab tests (tests/test_lab*.py, tests/bad_input/test_lab_run.py)."""

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook


def write_nb(path, *cells, params="x = 1\ny = 'text'", kernelspec=True):
    cs = [new_markdown_cell("# test notebook")]
    if params is not None:
        p = new_code_cell(params)
        p.metadata["tags"] = ["parameters"]
        cs.append(p)
    cs += [new_code_cell(c) for c in cells]
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"kernelspec": {"name": "python3", "language": "python", "display_name": "Python 3"}} if kernelspec \
        else {}
    nbformat.write(new_notebook(cells=cs, metadata=metadata), path)
    return path
