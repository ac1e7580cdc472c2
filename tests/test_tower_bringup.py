"""The tower bring-up (experiments/tower_bringup*.py, notebooks/tower_bringup.ipynb) on gemma4's
vision tower and on the audio towers (gemma3n's USM, gemma4's), every stage held bit-exact to
mlx-vlm 0.7.10 run live on the tower zoo's tiny checkpoints (by zoo name), its figures drawn, the
notebook run headless on an audio tower. (The ViT towers' bring-up: tests/test_towers.py; the
notebook on its defaults: tests/test_notebooks.py.)"""

from __future__ import annotations

import nbformat
import numpy as np
import pytest

import mlxbun.cli as cli
from mlxbun.errors import UnsupportedModelError
from mlxbun.experiments.tower_bringup import pick_media, tower_bringup
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
    with pytest.raises(UnsupportedModelError, match="does not stage a moonvit tower"):  # before mlx-vlm loads
        tower_bringup("zoo:kimi_vl-vision", zoo_root=zoo_root, record=False)
    with pytest.raises(UnsupportedModelError, match="does not stage Gemma3nImageModel's tower"):  # MobileNetV5
        tower_bringup("zoo:gemma3n-towers", zoo_root=zoo_root, record=False)


def test_the_notebook_runs_headless_on_an_audio_tower(zoo_root, tmp_path, monkeypatch, capfd):
    """notebooks/tower_bringup.ipynb on zoo:gemma3n-audio (media picked: audio): the log-mel frames,
    the per-frame diffs, the soft tokens drawn; no attention cell output; the verdict asserted."""
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    out = tmp_path / "out"
    code = cli.main(["lab", "run", "tower_bringup", "-p", "model", "zoo:gemma3n-audio", "--out", str(out),
                     "--results", str(tmp_path / "r.sqlite"), "--no-progress", "--timeout", "120"])
    assert code == 0, capfd.readouterr().err
    executed = nbformat.read(out / "tower_bringup.ipynb", 4)
    code_cells = [c for c in executed.cells if c.cell_type == "code"]
    pngs = [c for c in code_cells if any("image/png" in o.get("data", {}) for o in c.outputs)]
    shown = "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for c in code_cells for o in c.outputs)
    assert len(pngs) == 3 and "PASS" in shown and "frames_differing" in shown
