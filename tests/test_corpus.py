"""engine.train.corpus: the pinned archives (fetch with pip, sha256 check, a pre-filled directory for a machine
without network), reading inside wheels and sdists, dedup and splits by content, the mixes, and the manifest of the
real pinned corpus, derived a second way from the archives' member lists."""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from corpus_testing import make_archives, modules, sha256, write_lock, write_sdist, write_wheel
from engine.errors import EngineError
from engine.train import corpus
from engine.train.presets import get_preset, names

# The manifest of the archives pinned in engine/train/corpus.lock.toml, as recorded when they were pinned: it must
# come out the same on every machine and Python (3.10-3.12). A new pin or a new scanning rule changes it on purpose.
PINNED_MANIFEST = "d428aaa5650b4d51"


# ---- reading, dedup, splits ---------------------------------------------------------------------------------------

def test_scan_reads_wheels_and_sdists_dedupes_and_splits_by_content(tmp_path):
    sources = make_archives(tmp_path / "a", 40, 40)
    first = corpus.scan(sources)
    assert len({f.digest for f in first}) == len(first) == 80
    assert {f.group for f in first} == {"classic", "typed"}
    assert {f.split for f in first} == {"train", "validation", "test"}
    # the text comes from inside the archive, wheel (zip) and sdist (tar) alike
    want = {**modules("classic", 40, 1), **modules("typed-1.0/typed", 40, 2)}
    assert all(f.text() == want[f.member] for f in first)
    # another archive holding a copy of a file, a stub and a non-Python file adds nothing
    copy = next(f for f in first if f.group == "classic")
    extra = write_wheel(tmp_path / "extra-1.0-py3-none-any.whl",
                        {"x/same.py": copy.text(), "x/tiny.py": "x = 1\n", "x/notes.txt": "words " * 100})
    again = corpus.scan(sources + (("typed", (extra,)),))
    assert [f.digest for f in again] == [f.digest for f in first]
    assert next(f for f in again if f.digest == copy.digest).group == "classic"  # the first archive keeps it
    # a file's split depends on its content only, not on which other files exist
    half = corpus.scan(sources[:1])
    splits = {f.digest: f.split for f in first}
    assert all(splits[f.digest] == f.split for f in half)
    assert corpus.manifest_hash(first) != corpus.manifest_hash(half)


def test_manifest_ignores_archive_names_and_places(tmp_path):
    sources = make_archives(tmp_path / "a", 30, 30)
    moved = tuple((g, tuple(Path(shutil.copy(p, tmp_path / f"renamed-{g}{''.join(p.suffixes)}")) for p in ps))
                  for g, ps in sources)
    assert corpus.manifest_hash(corpus.scan(moved)) == corpus.manifest_hash(corpus.scan(sources))


def test_texts_keep_the_selection_order_across_archives(tmp_path):
    files = corpus.scan(make_archives(tmp_path, 60, 60))
    chosen = corpus.select("A", "train", 10**9, files)
    assert corpus.texts("A", "train", 10**9, files) == [f.text() for f in chosen]
    assert {f.archive.name for f in chosen} == {"classic-1.0-py3-none-any.whl", "typed-1.0.tar.gz"}


def test_mixes_differ_and_prompts_come_from_test_files(tmp_path):
    files = corpus.scan(make_archives(tmp_path))
    a = corpus.select("A", "train", 60_000, files)
    b = corpus.select("B", "train", 60_000, files)
    share = lambda fs: sum(f.size for f in fs if f.group == "classic") / sum(f.size for f in fs)  # noqa: E731
    assert 0.4 < share(a) < 0.6 and share(b) < 0.2
    prompts = corpus.prompts(3, chars=200, files=files)
    test_texts = corpus.texts("A", "test", 10**9, files)
    assert len(prompts) == 3 and all(any(p in t for t in test_texts) for p in prompts)
    assert all(p.endswith("\n") and len(p) <= 200 for p in prompts)


def test_mix_shares_hold_when_a_group_runs_short(tmp_path):
    files = corpus.scan(make_archives(tmp_path, 20, 200))
    a = corpus.select("A", "train", 10**9, files)
    classic = sum(f.size for f in a if f.group == "classic")
    assert classic == sum(f.size for f in files if f.group == "classic" and f.split == "train")  # all of it ...
    assert 0.4 < classic / sum(f.size for f in a) < 0.6  # ... and still half the mix


def test_empty_corpus_and_a_broken_archive_are_clear_errors(tmp_path):
    empty = write_wheel(tmp_path / "empty-1.0-py3-none-any.whl", {"README.txt": "no code\n"})
    files = corpus.scan((("classic", (empty,)), ("typed", ())))
    assert files == ()
    with pytest.raises(EngineError, match="empty corpus"):
        corpus.select("A", "train", 1000, files)
    junk = tmp_path / "junk-1.0.tar.gz"
    junk.write_bytes(b"not an archive at all" * 20)
    with pytest.raises(EngineError, match="junk-1.0.tar.gz is neither a zip"):
        corpus.scan((("classic", (junk,)),))


# ---- pinned archives: verify, fetch, offline ----------------------------------------------------------------------

@pytest.fixture
def pinned(tmp_path):
    """A lock of a synthetic wheel and sdist, the archives themselves in `index` (what pip would fetch)."""
    sources = make_archives(tmp_path / "index", 30, 30)
    lock = write_lock(tmp_path / "corpus.lock.toml", [(g, p) for g, ps in sources for p in ps])
    return lock, tmp_path / "index", sources


def no_pip(*args, **kwargs):
    raise AssertionError(f"pip must not run: {args}")


def fake_pip(index: Path, calls: list, tamper: bool = False):
    """subprocess.run standing in for `pip download`: copies the requested files from `index` into --dest."""
    def run(cmd, **kwargs):
        dest, reqs = Path(cmd[cmd.index("--dest") + 1]), Path(cmd[cmd.index("--requirement") + 1])
        lines = reqs.read_text().splitlines()
        calls.append((cmd, lines))
        for line in lines:
            name = line.split("==")[0]
            src = next(index.glob(f"{name}-1.0*"))
            data = bytearray(src.read_bytes())
            if tamper:
                data[len(data) // 2] ^= 1
            (dest / src.name).write_bytes(bytes(data))
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return run


def test_prefilled_directory_is_used_as_it_is_without_pip(pinned, tmp_path, monkeypatch):
    lock, index, sources = pinned
    monkeypatch.setattr(subprocess, "run", no_pip)
    monkeypatch.setenv(corpus.DIR_ENV, str(index))  # a directory copied from a machine with network
    got = corpus.fetch(lock)
    assert sorted(p.name for p in got.values()) == sorted(p.name for _, ps in sources for p in ps)
    assert sorted(p.name for p in index.iterdir()) == sorted(got_.name for got_ in got.values())  # only read
    assert corpus.manifest_hash(corpus.scan(corpus.pinned_sources(lock))) == corpus.manifest_hash(corpus.scan(sources))


def test_a_tampered_archive_is_refused(pinned, tmp_path, monkeypatch):
    lock, index, _ = pinned
    copy = tmp_path / "copy"
    shutil.copytree(index, copy)
    wheel = next(copy.glob("*.whl"))
    data = bytearray(wheel.read_bytes())
    data[len(data) // 2] ^= 1  # one byte
    wheel.write_bytes(bytes(data))
    monkeypatch.setattr(subprocess, "run", no_pip)
    with pytest.raises(EngineError, match=rf"corpus archive .*{wheel.name} does not match its pinned sha256"):
        corpus.pinned_sources(lock, copy)


def test_missing_archives_are_fetched_by_exact_version_and_hash(pinned, tmp_path, monkeypatch):
    lock, index, sources = pinned
    calls: list = []
    monkeypatch.setattr(subprocess, "run", fake_pip(index, calls))
    said: list[str] = []
    cache = tmp_path / "cache"
    got = corpus.fetch(lock, cache, say=said.append)
    assert len(said) == 1 and "fetching 2 pinned archive(s)" in said[0] and str(cache) in said[0]
    wheel_cmd, wheel_reqs = calls[0]
    sdist_cmd, sdist_reqs = calls[1]
    assert "--require-hashes" in wheel_cmd and "--only-binary=:all:" in wheel_cmd and "--no-deps" in wheel_cmd
    assert "--no-binary=:all:" in sdist_cmd
    classic = sources[0][1][0]
    assert wheel_reqs == [f"classic==1.0 --hash=sha256:{sha256(classic)}"]
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == sorted(
        p.name for p in got.values())
    # the second time everything is there: no pip
    monkeypatch.setattr(subprocess, "run", no_pip)
    assert corpus.fetch(lock, cache, say=said.append) == got and len(said) == 1


def test_a_fetched_file_that_does_not_match_is_refused_and_not_kept(pinned, tmp_path, monkeypatch):
    lock, index, _ = pinned
    monkeypatch.setattr(subprocess, "run", fake_pip(index, [], tamper=True))
    cache = tmp_path / "cache"
    with pytest.raises(EngineError, match="does not match its pinned sha256"):
        corpus.fetch(lock, cache, say=lambda m: None)
    assert [p.name for p in cache.iterdir() if not p.name.startswith(".")] == []  # nothing half-written


def test_pip_failure_is_one_clear_line(pinned, tmp_path, monkeypatch):
    lock, _, _ = pinned
    err = "WARNING: something noisy\nERROR: Could not find a version that satisfies the requirement classic==1.0\n"
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", err))
    with pytest.raises(EngineError, match=r"could not fetch .*\(ERROR: Could not find a version .*\); .* set "
                                          r"SPECBOOK_CORPUS_DIR"):
        corpus.fetch(lock, tmp_path / "cache", say=lambda m: None)


def test_corpus_dir_from_the_environment(tmp_path, monkeypatch):
    for var in (corpus.DIR_ENV, corpus.CACHE_ENV):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert corpus.corpus_dir() == tmp_path / "xdg" / "specbook" / "corpus"
    monkeypatch.setenv(corpus.CACHE_ENV, str(tmp_path / "c"))
    assert corpus.corpus_dir() == tmp_path / "c" / "corpus"
    monkeypatch.setenv(corpus.DIR_ENV, str(tmp_path / "given"))
    assert corpus.corpus_dir() == tmp_path / "given"


def test_cli_fetch_names_the_directory_to_copy(pinned, monkeypatch):
    from engine.train.cli import train_command

    lock, index, _ = pinned
    monkeypatch.setattr(corpus, "LOCK", lock)
    monkeypatch.setattr(subprocess, "run", no_pip)
    monkeypatch.setenv(corpus.DIR_ENV, str(index))
    r = CliRunner().invoke(train_command, ["corpus", "--fetch"])
    assert r.exit_code == 0 and f"2 archives verified in {index}" in r.output


# ---- the real pinned corpus ---------------------------------------------------------------------------------------

def independent_manifest(archives: list[tuple[str, Path]]) -> str:
    """The manifest from the archives' member lists, read with zipfile alone: .py members within the size limits,
    the first copy of each content kept, sorted by content hash."""
    kept: dict[str, tuple[str, int]] = {}
    for group, path in archives:
        with zipfile.ZipFile(path) as z:
            for info in sorted(z.infolist(), key=lambda i: i.filename):
                if info.filename.endswith(".py") and 256 <= info.file_size <= 512 * 1024:
                    kept.setdefault(hashlib.blake2b(z.read(info), digest_size=16).hexdigest(), (group, info.file_size))
    lines = "".join(f"{g}\0{size}\0{d}\n" for d, (g, size) in sorted(kept.items()))
    return hashlib.sha256(lines.encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def real():
    """The pinned corpus from the cache (fetched from the package index on first use)."""
    paths = corpus.fetch()
    return paths, corpus.scan()


def test_pinned_corpus_manifest_is_the_recorded_one(real):
    paths, files = real
    assert all(p.is_wheel for p in paths)  # independent_manifest reads zips
    assert corpus.manifest_hash(files) == corpus.manifest_hash() == PINNED_MANIFEST
    assert independent_manifest([(p.group, path) for p, path in paths.items()]) == PINNED_MANIFEST


def test_presets_fit_in_the_pinned_corpus(real):
    """Every run of every preset gets the bytes it asks for: select() would shrink a mix that the corpus cannot fill,
    and the run would silently train on less."""
    _, files = real
    for preset in map(get_preset, names()):
        for run in (preset.target_a, preset.target_b, preset.drafter, preset.finetune):
            got = sum(f.size for f in corpus.select(run.mix, "train", run.data_bytes, files))
            assert got >= 0.99 * run.data_bytes, (preset.name, run)
        for mix in "AB":
            got = sum(f.size for f in corpus.select(mix, "train", preset.tokenizer_bytes // 2, files))
            assert got >= 0.99 * preset.tokenizer_bytes // 2, (preset.name, mix)
    assert len(corpus.prompts(get_preset("gpu").eval_prompts, get_preset("gpu").prompt_chars, files=files)) == 16
