"""Hub repos on demand (`mlxbun.hub`, `locate`, `--offline`) against a loopback hub
(`tests/hub_server.py`): huggingface_hub itself is the client, pointed at 127.0.0.1 through its
HF_ENDPOINT constants; nothing reaches the internet."""

import json

import pytest
from huggingface_hub import constants, file_download

from mlxbun import cli, hub
from mlxbun.locate import locate
from mlxbun.names import parse_model
from mlxbun.snapshot_identity import artifact_fingerprint
from tests.hub_server import README, REPO, loopback  # noqa: F401  (the loopback hub fixture)

SHARD = "model-00001-of-00002.safetensors"


def _files(server, kinds=("GET", "HEAD")):
    return [(m, p) for m, p, _ in server.requests if m in kinds and "/resolve/" in p]


def test_repo_names_take_a_revision():
    spec = parse_model("org/repo@v1.0")
    assert (spec.kind, spec.value, spec.revision, str(spec)) == ("hub", "org/repo", "v1.0", "org/repo@v1.0")
    assert parse_model("org/repo").revision is None and parse_model("org/repo@refs/pr/1").revision == "refs/pr/1"


def test_download_once_then_the_cache(loopback, zoo):
    path = locate(REPO)
    sha = loopback.repos[REPO].refs["main"]
    assert artifact_fingerprint(path) == f"hf:{REPO}@{sha}"
    names = sorted(p.name for p in path.iterdir())
    assert "README.md" not in names and SHARD in names  # only what the graph reads
    for name in names:
        assert (path / name).read_bytes() == (zoo("llama") / name).read_bytes(), name
    loopback.requests.clear()
    assert locate(REPO) == path
    assert _files(loopback) == []  # reused: one revision lookup, no file request
    assert [p for _, p, _ in loopback.requests] == [f"/api/models/{REPO}/revision/main"]


def test_generate_runs_a_downloaded_repo(loopback, zoo, capsys):
    def tokens(model):
        assert cli.main(["generate", "--model", model, "--prompt-ids", "1,2,3", "--max-tokens", "4", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["tokens"]

    assert tokens(REPO) == tokens(str(zoo("llama")))


def test_a_new_revision_fetches_only_what_changed_and_pins_stay(loopback, zoo):
    first = locate(REPO)
    old = loopback.repos[REPO].refs["main"]
    new = loopback.add(REPO, zoo("llama"), extra={"README.md": README, "generation_config.json": b'{"eos_token_id": 2}'})
    loopback.add(REPO, zoo("llama"), branch="v1", extra={"README.md": README})  # a tag on the first commit's files
    loopback.requests.clear()
    second = locate(REPO)
    assert second.name == new != old and (second / "generation_config.json").read_bytes() == b'{"eos_token_id": 2}'
    assert [p.rsplit("/", 1)[1] for _, p in _files(loopback, ("GET",))] == ["generation_config.json"]
    loopback.requests.clear()
    assert locate(f"{REPO}@{old}") == first and loopback.requests == []  # a commit: nothing to ask
    assert locate(f"{REPO}@v1") == first and _files(loopback, ("GET",)) == []


def test_offline_without_a_main_ref_takes_the_newest_complete_snapshot(loopback, zoo):
    sha = loopback.repos[REPO].refs["main"]
    path = locate(f"{REPO}@{sha}")  # a commit pins no branch: the cache has no refs/main
    assert not (path.parents[1] / "refs" / "main").exists()
    assert hub.fetch(REPO, offline=True) == path


def test_a_gated_repo_downloads_with_hf_token(loopback, zoo, monkeypatch):
    loopback.add("mlxbun-test/gated", zoo("llama"), gated=True)
    with pytest.raises(hub.HubGated):
        locate("mlxbun-test/gated")
    monkeypatch.setenv("HF_TOKEN", loopback.token)
    assert (locate("mlxbun-test/gated") / SHARD).is_file()


def test_offline_uses_the_cache_alone_and_refuses_what_it_lacks(loopback, capsys):
    path = locate(REPO)
    loopback.requests.clear()
    argv = ["explain", REPO, "--json", "--offline"]
    assert cli.main(argv) == 0 and json.loads(capsys.readouterr().out)["model_type"] == "llama"
    assert hub.is_offline() and locate(REPO) == path
    assert cli.main(["generate", "--model", "mlxbun-test/never-fetched", "--prompt", "hi", "--offline"]) == 1
    err = capsys.readouterr().err
    assert "repo 'mlxbun-test/never-fetched' not found in hub cache" in err and "downloads are off" in err, err
    assert loopback.requests == []


@pytest.mark.parametrize("case, error, words", [
    ("no-repo", hub.HubNotFound, "repo 'mlxbun-test/nope' not found on http://127.0.0.1"),
    ("no-revision", hub.HubNotFound, "has no revision 'v9'"),
    ("gated", hub.HubGated, "is gated: accept its terms at http://127.0.0.1"),
    ("pytorch-only", hub.HubNotFound, "has no safetensors weights"),
    ("disk-full", hub.HubDiskFull, "nothing was downloaded"),
])
def test_bad_repos_are_named_errors_that_download_nothing(loopback, zoo, tmp_path, monkeypatch, case, error, words):
    name = {"no-repo": "mlxbun-test/nope", "no-revision": f"{REPO}@v9"}.get(case, "mlxbun-test/other")
    if case == "gated":
        loopback.add("mlxbun-test/other", zoo("llama"), gated=True)
    if case == "pytorch-only":
        (tmp_path / "pt").mkdir()
        (tmp_path / "pt" / "config.json").write_text('{"model_type": "llama"}')
        (tmp_path / "pt" / "pytorch_model.bin").write_bytes(b"\0" * 64)
        loopback.add("mlxbun-test/other", tmp_path / "pt")
    if case == "disk-full":
        loopback.add("mlxbun-test/other", zoo("llama"))
        monkeypatch.setattr(hub.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    with pytest.raises(error, match=words):
        locate(name)
    assert _files(loopback, ("GET",)) == []
    assert not list((tmp_path / "hub").glob("models--*/snapshots/*/*"))


def test_an_interrupted_transfer_resumes_where_it_stopped(loopback, zoo, monkeypatch):
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)  # whole chunks arrive before the cut
    monkeypatch.setattr(file_download, "time", type("T", (), {"sleep": staticmethod(lambda s: None)}))
    loopback.faults[SHARD] = "cut_once"
    path = locate(REPO)
    ranges = loopback.gets(SHARD)
    assert len(ranges) == 2 and ranges[0] is None and ranges[1].startswith("bytes=") and ranges[1] != "bytes=0-"
    assert (path / SHARD).read_bytes() == (zoo("llama") / SHARD).read_bytes()


def test_a_failed_transfer_leaves_no_model_and_the_next_run_completes_it(loopback, zoo, monkeypatch):
    monkeypatch.setattr(file_download, "time", type("T", (), {"sleep": staticmethod(lambda s: None)}))
    loopback.faults[SHARD] = "cut_always"
    with pytest.raises(hub.HubDownloadError, match="download interrupted .* the next run fetches the rest"):
        locate(REPO)
    with pytest.raises(hub.HubNotCached, match=f"only partly in hub cache .*missing {SHARD}"):
        hub.fetch(REPO, offline=True)
    del loopback.faults[SHARD]
    loopback.requests.clear()
    path = locate(REPO)
    assert [p.rsplit("/", 1)[1] for _, p in _files(loopback, ("GET",))] == [SHARD]  # the rest stayed
    assert (path / SHARD).read_bytes() == (zoo("llama") / SHARD).read_bytes()


def test_the_hf_variables_reach_a_fresh_process(loopback, tmp_path):
    """HF_ENDPOINT, HF_HUB_CACHE and HF_HUB_OFFLINE as a user sets them, read by huggingface_hub at
    import in a new `mlxbun` process (the fixture's in-process settings do not travel)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_ENDPOINT": loopback.url, "HF_HUB_CACHE": str(tmp_path / "env-cache"),
           "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}

    def mlxbun(*argv, **extra):
        return subprocess.run([sys.executable, "-m", "mlxbun", *argv], env={**env, **extra}, capture_output=True,
                              text=True, timeout=120)

    online = mlxbun("explain", REPO, "--json")
    assert online.returncode == 0 and json.loads(online.stdout)["model_type"] == "llama", online.stderr
    assert f"downloading {REPO}" in online.stderr and str(tmp_path / "env-cache") in online.stderr
    loopback.requests.clear()
    offline = mlxbun("explain", REPO, "--json", HF_HUB_OFFLINE="1")
    assert offline.returncode == 0 and loopback.requests == [], offline.stderr
    refused = mlxbun("explain", "mlxbun-test/never-fetched", HF_HUB_OFFLINE="1")
    assert refused.returncode == 1 and "downloads are off" in refused.stderr and loopback.requests == []


def test_the_readme_hub_commands_run(loopback, zoo, tmp_path, monkeypatch, capsys):
    """The first hour's hub block, against the loopback hub serving zoo:llama under the block's real
    repo id (the real one needs network)."""
    import re
    import shlex
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    first_hour = readme[readme.index("## The first hour"):readme.index("## Commands")]
    block = re.search(r"Hugging Face hub, by its repo id.*?```sh\n(.*?)```", first_hour, re.S).group(1)
    commands = [argv[1:] for argv in map(lambda line: shlex.split(line, comments=True), block.splitlines()) if argv]
    repos = {a for argv in commands for a in argv if re.fullmatch(r"[\w.-]+/[\w.-]+", a)}
    assert len(repos) == 1 and {argv[0] for argv in commands} == {"generate", "convert"}, commands
    loopback.add(repos.pop(), zoo("llama"), extra={"README.md": README})
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        assert cli.main(argv) == 0, (argv, capsys.readouterr().err)


def test_a_disk_that_fills_during_the_download_is_named(loopback, monkeypatch):
    import errno

    def full(src, dst):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(file_download, "_chmod_and_move", full)
    with pytest.raises(hub.HubDiskFull, match="filled up during the download"):
        locate(REPO)
    with pytest.raises(hub.HubNotCached, match="only partly in hub cache"):
        hub.fetch(REPO, offline=True)


def test_an_unreachable_hub_falls_back_to_the_cache(loopback, monkeypatch):
    import socket

    path = locate(REPO)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", dead + "/{repo_id}/resolve/{revision}/{filename}")
    assert locate(REPO) == path
    with pytest.raises(hub.HubNotCached, match="cannot be reached"):
        locate("mlxbun-test/never-fetched")
