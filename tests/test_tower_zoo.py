"""The tower zoo's checkpoints (mlxbun.zoo.towers: tiny VLMs with their towers) by zoo name,
`zoo:gemma3-vision`, ... (the registry's builders), wherever a model is taken: locate, open_vlm /
open_alm, `mlxbun generate --image`; their options checked before anything is built, an unknown
name refused by the zoo's named error. (`mlxbun zoo list` / `build`: tests/test_zoo.py.)"""

from __future__ import annotations

import json

import pytest

import mlxbun.cli as cli
from mlxbun.errors import UnsupportedModelError
from mlxbun.locate import locate
from mlxbun.multimodal import open_alm, open_vlm, stream_generate
from mlxbun.towers.errors import NoTowerError
from mlxbun.zoo import ZooArgumentError, check_build
from mlxbun.zoo.towers import cached_tower_checkpoint
from tests.conftest import sample_image


def test_tower_zoo_names_resolve_to_the_tower_checkpoints(zoo_root, tmp_path):
    path = locate("zoo:gemma3-vision", zoo_root=zoo_root)
    assert path == cached_tower_checkpoint("gemma3-vision", root=zoo_root) and path.name == "tiny-gemma3-vision"
    assert locate("zoo:gemma3", zoo_root=zoo_root) != path  # the text-only wrapper keeps its name
    # names and options as the text zoo's, checked before anything is built
    assert check_build("gemma3-vision", tmp_path, quant=8, dtype="bfloat16", seed=1).name == \
        "tiny-gemma3-vision-bf16-q8-s1"
    with pytest.raises(UnsupportedModelError, match="unknown zoo arch 'gemma3-visio'; known archs: .*gemma3-vision"):
        locate("zoo:gemma3-visio", zoo_root=zoo_root)
    with pytest.raises(ZooArgumentError, match="no mxfp4"):
        locate("zoo:gemma3-vision@mxfp4", zoo_root=zoo_root)
    with pytest.raises(ZooArgumentError, match="head_dim widens the text zoo's heads only"):
        locate("zoo:gemma3-vision,head_dim=32", zoo_root=zoo_root)
    with pytest.raises(ZooArgumentError, match="plain directory only"):
        check_build("gemma3n-audio", tmp_path, hf_cache=True)
    assert list(tmp_path.iterdir()) == []


def test_open_vlm_and_open_alm_take_zoo_names(zoo_root, monkeypatch):
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    vlm = open_vlm("zoo:gemma3-vision")
    assert vlm.path == cached_tower_checkpoint("gemma3-vision", root=zoo_root)
    alm = open_alm("zoo:gemma3n-audio")
    assert alm.path == cached_tower_checkpoint("gemma3n-audio", root=zoo_root)
    with pytest.raises(NoTowerError, match="llama is a text model"):
        open_vlm("zoo:llama")


def test_cli_generates_from_a_tower_zoo_name_with_an_image(zoo_root, monkeypatch, capsys):
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    prompt, image = "<start_of_image> what", sample_image("grace_hopper.jpg")
    code = cli.main(["generate", "--model", "zoo:gemma3-vision", "--image", image, "--prompt", prompt,
                     "--max-tokens", "4", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["images"] == 1 and out["soft_tokens"] == 4
    vlm = open_vlm(cached_tower_checkpoint("gemma3-vision", root=zoo_root))
    media = vlm.prepare(prompt, [image])
    assert out["prompt_ids"] == media.ids.tolist()
    assert out["tokens"] == [r.token for r in stream_generate(vlm, media, max_tokens=4)]
    code = cli.main(["generate", "--model", "zoo:gemma3-visio", "--image", image, "--prompt", "x"])
    err = capsys.readouterr().err
    assert code == 1 and "unknown zoo arch 'gemma3-visio'" in err and len(err.strip().splitlines()) == 1


def test_zoo_build_writes_a_tower_checkpoint_by_its_name(zoo_root, tmp_path, capsys):
    import hashlib

    def digest(path):
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}

    assert cli.main(["zoo", "build", "gemma3-vision", "--out", str(tmp_path)]) == 0
    name, built = capsys.readouterr().out.strip().split("\t")
    assert name == "gemma3-vision" and built == str(tmp_path / "tiny-gemma3-vision")
    assert digest(tmp_path / "tiny-gemma3-vision") == digest(cached_tower_checkpoint("gemma3-vision", root=zoo_root))
    assert cli.main(["zoo", "build", "gemma3-vision", "--out", str(tmp_path), "--quant", "mxfp4"]) == 1
    assert "no mxfp4" in capsys.readouterr().err
