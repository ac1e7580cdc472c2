"""The tower bring-up (experiments/tower_bringup*.py, notebooks/tower_bringup.ipynb) on gemma4's
vision tower, gemma3n's MobileNetV5, kimi_vl's MoonViT and the audio towers (gemma3n's USM,
gemma4's), every stage held bit-exact to mlx-vlm 0.7.10 run live on the tower zoo's tiny float32
checkpoints (by zoo name), its figures drawn, the notebook run headless on an audio tower and on
MoonViT. (The ViT towers' bring-up: tests/test_towers.py; the notebook on its defaults:
tests/test_notebooks.py.)"""

from __future__ import annotations

import types

import nbformat
import numpy as np
import pytest

import mlxbun.cli as cli
from mlxbun.errors import UnsupportedModelError
from mlxbun.experiments.tower_bringup import _image_bringup, pick_media, tower_bringup
from mlxbun.locate import locate
from mlxbun.names import NamingError
from mlxbun.towers.errors import NoTowerError


def _figures(run):
    figs = [run.input_figure(), run.diff_figure(), run.soft_tokens_figure()]
    if run.attention is not None:
        figs.append(run.attention_figure())
    assert all(f.axes for f in figs)


def test_bringup_holds_gemma4_s_vision_tower_patch_by_patch(zoo_root):
    run = tower_bringup("zoo:gemma4-towers", zoo_root=zoo_root, record=False)
    assert run.media == "image" and run.bit_exact, run.verdict()
    assert run.stages == ["embeddings", "layers.0", "pooler", "projector"]
    rows, cols = run.grid_shape
    assert rows % 3 == 0 and cols % 3 == 0 and rows * cols <= 36  # 16-pixel patches, at most 4 tokens of 3x3
    assert run.grids["layers.0"].shape == (rows, cols) and run.grids["projector"].shape == (rows // 3, cols // 3)
    assert run.image.shape == (rows * 16, cols * 16, 3) and run.soft_tokens.shape[0] == rows * cols // 9
    assert run.prompt_ids.count(run.token_id) == rows * cols // 9
    assert run.attention.shape == (2, rows * cols, rows * cols)
    assert np.allclose(run.attention.sum(-1), 1.0, atol=1e-5)
    _figures(run)


def test_bringup_holds_mobilenet_v5_block_by_block(zoo_root):
    """gemma3n-towers' tiny MobileNetV5 (mlx-vlm built under its layout): the stem, each block of
    each stage over its own feature map, the MSFA and the tokens over the 2 x 2 output grid."""
    run = tower_bringup("zoo:gemma3n-towers", zoo_root=zoo_root, record=False)
    assert run.media == "image" and run.bit_exact, run.verdict()
    blocks = [f"blocks.{s}.{b}" for s, n in enumerate((2, 2, 4, 3)) for b in range(n)]
    assert run.stages == ["stem", *blocks, "msfa", "get_image_features", "embed_vision"]
    sides = [32, 16, 16, 8, 8, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2]  # a 64 x 64 image, strides 2, 2, 2, 2, 2
    assert [run.grids[s].shape for s in run.stages] == [(n, n) for n in sides]
    assert run.image.shape == (64, 64, 3) and run.patch_size == (32, 32) and run.grid_shape == (2, 2)
    assert run.patch_numbers.tolist() == [[0, 2], [1, 3]]  # get_image_features reads the map column by column
    assert run.soft_tokens.shape == (4, 64) and run.prompt_ids.count(run.token_id) == 4
    assert run.attention is None and "cells_differing" in run.table()
    _figures(run)
    with pytest.raises(UnsupportedModelError, match="MobileNetV5's bring-up draws no attention maps"):
        tower_bringup("zoo:gemma3n-towers", zoo_root=zoo_root, record=False, attention_layer=0)


def test_bringup_holds_moonvit_patch_by_patch(zoo_root):
    """kimi_vl-vision's MoonViT on the sample photograph (cropped to 42 x 36 patches: the position
    table resized): each stage over the patch grid, the merger's windows drawn back on it."""
    run = tower_bringup("zoo:kimi_vl-vision", zoo_root=zoo_root, record=False, attention_layer=0)
    assert run.media == "image" and run.bit_exact, run.verdict()
    assert run.stages == ["embeddings", "layers.0", "layers.1", "post_layernorm", "merged", "projector"]
    rows, cols = run.grid_shape
    assert (rows, cols) == (42, 36) and run.image.shape == (rows * 14, cols * 14, 3)
    assert all(run.grids[s].shape == (rows, cols) for s in run.stages[:-1])
    assert run.grids["projector"].shape == (rows // 2, cols // 2)
    assert run.soft_tokens.shape[0] == rows * cols // 4 == run.prompt_ids.count(run.token_id)
    assert run.attention_layer == 0 and run.attention.shape == (2, rows * cols, rows * cols)
    assert np.allclose(run.attention.sum(-1), 1.0, atol=1e-5)
    _figures(run)


@pytest.mark.parametrize("model,blocks,tokens", [("zoo:gemma3n-audio", "conformer", 8),
                                                  ("zoo:gemma3n-towers", "conformer", 8),  # mlx-vlm: its layout
                                                  ("zoo:gemma4-towers", "layers", 15)])
def test_bringup_holds_audio_towers_frame_by_frame(zoo_root, tmp_path, model, blocks, tokens):
    from mlxbun.results import open_results

    db = tmp_path / "results.sqlite"
    run = tower_bringup(model, media="audio", zoo_root=zoo_root, results_path=db)
    assert run.media == "audio" and run.bit_exact and run.verdict().startswith("PASS"), run.verdict()
    assert run.stages == ["subsample", f"{blocks}.0", f"{blocks}.1", "output", "embedder"]
    assert all(g.ndim == 2 and g.shape[0] == 1 for g in run.grids.values())
    frames = run.grids["subsample"].shape[1]
    assert run.grids[f"{blocks}.1"].shape[1] == frames and run.grids["output"].shape[1] <= frames
    assert run.mel.shape[0] == run.mel_mask.shape[0] and run.mel.shape[1] in (32, 128) and run.mel_mask.any()
    assert run.soft_tokens.shape[0] == tokens == run.prompt_ids.count(run.token_id)
    assert run.attention is None and "frames_differing" in run.table()
    with pytest.raises(Exception, match="no attention maps"):
        run.attention_figure()
    _figures(run)
    with open_results(db, create=False) as store:
        rows = store.load(expand_params=True)
    assert (rows[rows.metric == "max_abs_diff"].value == 0).all() and set(rows["params.media"]) == {"audio"}
    run.stage_max[f"{blocks}.1"] = 1e-7  # a stage that differs is named by the verdict
    assert f"first stage that differs: {blocks}.1; log-mel frames equal: True" in run.verdict()


def test_bringup_picks_the_tower_and_refuses_by_name(zoo_root):
    assert pick_media(locate("zoo:gemma3n-audio", zoo_root=zoo_root)) == "audio"
    assert pick_media(locate("zoo:gemma4-towers", zoo_root=zoo_root)) == "image"
    with pytest.raises(NoTowerError, match="no tower to bring up .*no vision_config.*without an audio tower"):
        pick_media(locate("zoo:gemma3", zoo_root=zoo_root))
    with pytest.raises(NamingError, match="media 'video'"):
        pick_media(None, "video")
    with pytest.raises(NoTowerError, match="without an audio tower"):
        tower_bringup("zoo:gemma3-vision", media="audio", zoo_root=zoo_root, record=False)
    with pytest.raises(UnsupportedModelError, match="does not stage SimpleNamespace's tower"):  # none other built
        _image_bringup(types.SimpleNamespace(path="elsewhere"))


def _notebook(zoo_root, tmp_path, monkeypatch, capfd, *params: str) -> tuple[int, str]:
    """notebooks/tower_bringup.ipynb run headless (`mlxbun lab run`) with `params` (-p pairs): the code
    cells that drew a PNG, and the text the code cells showed."""
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    out = tmp_path / "out"
    pairs = [w for i in range(0, len(params), 2) for w in ("-p", params[i], params[i + 1])]
    code = cli.main(["lab", "run", "tower_bringup", *pairs, "--out", str(out), "--results", str(tmp_path / "r.sqlite"),
                     "--no-progress", "--timeout", "120"])
    assert code == 0, capfd.readouterr().err
    code_cells = [c for c in nbformat.read(out / "tower_bringup.ipynb", 4).cells if c.cell_type == "code"]
    pngs = sum(any("image/png" in o.get("data", {}) for o in c.outputs) for c in code_cells)
    return pngs, "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for c in code_cells
                         for o in c.outputs)


def test_the_notebook_runs_headless_on_an_audio_tower(zoo_root, tmp_path, monkeypatch, capfd):
    """notebooks/tower_bringup.ipynb on zoo:gemma3n-audio (media picked: audio): the log-mel frames,
    the per-frame diffs, the soft tokens drawn; no attention cell output; the verdict asserted."""
    pngs, shown = _notebook(zoo_root, tmp_path, monkeypatch, capfd, "model", "zoo:gemma3n-audio")
    assert pngs == 3 and "PASS" in shown and "frames_differing" in shown


def test_the_notebook_runs_headless_on_moonvit(zoo_root, tmp_path, monkeypatch, capfd):
    """notebooks/tower_bringup.ipynb on zoo:kimi_vl-vision: the image with its patches, the per-patch
    diffs, the soft tokens and block 0's attention maps drawn; the verdict asserted."""
    pngs, shown = _notebook(zoo_root, tmp_path, monkeypatch, capfd, "model", "zoo:kimi_vl-vision",
                            "attention_layer", "0")
    assert pngs == 4 and "PASS: 6 stages" in shown and "patches_differing" in shown
