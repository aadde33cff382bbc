"""Saving never destroys what it did not write: only a directory that is a checkpoint is
replaced (else a clear error, or overwrite=True), every save stages in a directory of its own,
a save to a path with an asynchronous save pending waits for it, two jobs replacing one path
take turns, what appears at the path during a save is kept, a trailing slash is the same path,
and files and directories are on disk (fsync) before the renames. The converter refuses a
non-empty output unless told to overwrite and leaves nothing behind when it fails."""
import glob
import os

import pytest
import torch
from models import build_model


def _model(value=None):
    model = build_model("qwen3_moe")
    if value is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(value)
    return model


def _first_value(model):
    return next(model.parameters()).flatten()[0].item()


def _staging_left(path):
    return glob.glob(os.fspath(path) + ".partial*")


def test_a_directory_that_is_not_a_checkpoint_is_not_replaced(tmp_path):
    from fsdpturbo import load_checkpoint, save_checkpoint

    run = tmp_path / "run"
    (run / "hf_export").mkdir(parents=True)
    for name in ("train.log", "notes.md", "hf_export/model.safetensors"):
        (run / name).write_text(name)
    before = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
    with pytest.raises(FileExistsError, match=r"'.*run' exists and is not a checkpoint .*overwrite=True"):
        save_checkpoint(_model(), None, run)
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == before
    assert not _staging_left(run)
    save_checkpoint(_model(1.0), None, run, overwrite=True)
    model = _model(0.0)
    load_checkpoint(model, None, run)
    assert _first_value(model) == 1.0


def test_a_file_at_the_path_is_not_replaced(tmp_path):
    from fsdpturbo import save_checkpoint

    (tmp_path / "ckpt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not a checkpoint"):
        save_checkpoint(_model(), None, tmp_path / "ckpt")
    assert (tmp_path / "ckpt").read_text() == "mine"


def test_a_checkpoint_is_replaced_and_nothing_else_is_touched(tmp_path):
    """The previous checkpoint is replaced; a `.partial` or `.old` directory that is not one of
    this save's (another job's, the user's) is left alone."""
    from fsdpturbo import load_checkpoint, save_checkpoint

    where = tmp_path / "ckpt"
    save_checkpoint(_model(1.0), None, where, extra={"step": 1})
    (tmp_path / "ckpt.partial").mkdir()
    (tmp_path / "ckpt.partial" / "keep").write_text("another job's")
    save_checkpoint(_model(2.0), None, where, extra={"step": 2})
    assert (tmp_path / "ckpt.partial" / "keep").read_text() == "another job's"
    model = _model(0.0)
    assert load_checkpoint(model, None, where)["step"] == 2 and _first_value(model) == 2.0

    (tmp_path / "ckpt.old").mkdir()
    (tmp_path / "ckpt.old" / "keep").write_text("the user's")
    with pytest.raises(FileExistsError, match=r"ckpt\.old' exists and is not a checkpoint"):
        save_checkpoint(_model(3.0), None, where, extra={"step": 3})
    assert (tmp_path / "ckpt.old" / "keep").read_text() == "the user's"
    assert load_checkpoint(model, None, where)["step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.old", "ckpt.partial"]


def test_a_trailing_slash_names_the_same_checkpoint(tmp_path):
    from fsdpturbo import load_checkpoint, save_checkpoint

    where = str(tmp_path / "ckpt") + os.sep
    save_checkpoint(_model(1.0), None, where, extra={"step": 1})
    save_checkpoint(_model(2.0), None, where, extra={"step": 2})
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    model = _model(0.0)
    assert load_checkpoint(model, None, where)["step"] == 2 and _first_value(model) == 2.0


def test_a_save_makes_the_directories_above_its_path(tmp_path):
    """`ckpt/step-500` before any `ckpt/` exists, as a trainer's first save names it."""
    from fsdpturbo import load_checkpoint, save_checkpoint

    where = tmp_path / "run" / "ckpt" / "step-500"
    save_checkpoint(_model(3.0), None, where, extra={"step": 500})
    assert sorted(os.listdir(where.parent)) == ["step-500"]
    model = _model(0.0)
    assert load_checkpoint(model, None, where)["step"] == 500 and _first_value(model) == 3.0


def test_a_save_waits_for_the_pending_save_to_the_same_path(tmp_path, monkeypatch):
    """An asynchronous save not yet waited, then another save to the same path, however spelt
    (relative, absolute, through a link): the second completes the first before it starts, so
    the result is the second save, whole."""
    from fsdpturbo import load_checkpoint, save_checkpoint

    monkeypatch.chdir(tmp_path)
    os.symlink(".", tmp_path / "here")
    where = tmp_path / "ckpt"
    for spelling in ("ckpt", f"{tmp_path}/ckpt/", "here/./ckpt"):
        pending = save_checkpoint(_model(1.0), None, where, extra={"step": 1}, async_save=True)
        save_checkpoint(_model(2.0), None, spelling, extra={"step": 2})
        pending.wait()  # already complete: returns at once
        model = _model(0.0)
        assert load_checkpoint(model, None, where)["step"] == 2 and _first_value(model) == 2.0
        assert sorted(os.listdir(tmp_path)) == ["ckpt", "here"]


def _record_syncs_and_renames(monkeypatch):
    events = []
    fsync, rename = os.fsync, os.rename

    def record_fsync(fd):
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    def record_rename(src, dst, *args, **kwargs):
        events.append(("rename", os.fspath(src)))
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "rename", record_rename)
    return events


def _synced_before_the_rename(events, name):
    """The paths synced before the staging directory of `name` was renamed into place, and
    that directory."""
    renames = [i for i, (kind, src) in enumerate(events)
               if kind == "rename" and os.path.basename(src).startswith(f"{name}.partial")]
    assert renames, events
    return {p for kind, p in events[:renames[0]] if kind == "fsync"}, events[renames[0]][1]


def test_files_and_directories_are_synced_before_the_renames(tmp_path, monkeypatch):
    from fsdpturbo import save_checkpoint

    events = _record_syncs_and_renames(monkeypatch)
    save_checkpoint(_model(), None, tmp_path / "ckpt", extra={"step": 1})
    synced, staging = _synced_before_the_rename(events, "ckpt")
    synced, staging = {os.path.basename(p) for p in synced}, os.path.basename(staging)
    for name in ("extra.pt", "fsdpturbo.json", "rank0.pt", ".metadata.tmp", "__0_0.distcp", "rng", "model", staging):
        assert name in synced, f"{name} was not synced before the rename ({sorted(synced)})"
    assert events[-1] == ("fsync", str(tmp_path)), "the parent directory is synced after the rename"


def test_every_file_a_conversion_writes_is_synced_before_the_rename(tmp_path, monkeypatch):
    from fsdpturbo import convert, save_checkpoint

    save_checkpoint(_model(1.0), None, tmp_path / "ckpt", extra={"step": 1})
    events = _record_syncs_and_renames(monkeypatch)
    convert.dcp_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), max_shard_bytes=16 << 10)
    convert.hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"))
    for out in ("hf", "dcp"):
        synced, staging = _synced_before_the_rename(events, out)
        final = tmp_path / out
        written = [os.path.relpath(os.path.join(root, name), final)
                   for root, dirs, files in os.walk(final) for name in files + dirs]
        expected = {os.path.join(staging, path) for path in written} | {staging}
        assert len(expected) > 3 and expected <= synced, f"{out}: not synced {sorted(expected - synced)}"


def test_the_converter_refuses_a_non_empty_output(tmp_path):
    """`to-hf` into a directory holding an older conversion: refused without --overwrite (the
    old index would win over the new single file); with it, the output is the new one alone."""
    from fsdpturbo import convert, save_checkpoint
    from fsdpturbo.weights import checkpoint_files

    save_checkpoint(_model(1.0), None, tmp_path / "one", extra={"step": 1})
    save_checkpoint(_model(5.0), None, tmp_path / "five", extra={"step": 1})
    convert.dcp_to_hf(str(tmp_path / "one"), str(tmp_path / "out"), max_shard_bytes=16 << 10)
    assert len(checkpoint_files(tmp_path / "out")) > 1
    assert convert.main(["to-hf", str(tmp_path / "five"), str(tmp_path / "out")]) == 1
    with pytest.raises(FileExistsError, match=r"'.*out' exists and is not empty.* overwrite"):
        convert.dcp_to_hf(str(tmp_path / "five"), str(tmp_path / "out"))
    assert convert.main(["to-hf", str(tmp_path / "five"), str(tmp_path / "out"), "--overwrite"]) == 0
    assert [os.path.basename(f) for f in checkpoint_files(tmp_path / "out")] == ["model.safetensors"]
    assert not os.path.exists(tmp_path / "out" / "model.safetensors.index.json")
    assert not _staging_left(tmp_path / "out")


def test_a_failed_conversion_leaves_no_output(tmp_path):
    from fsdpturbo import convert, save_checkpoint

    save_checkpoint(_model(1.0), None, tmp_path / "ckpt", extra={"step": 1})
    data = tmp_path / "ckpt" / "model" / "__0_0.distcp"
    os.truncate(data, os.path.getsize(data) // 2)
    assert convert.main(["to-hf", str(tmp_path / "ckpt"), str(tmp_path / "out")]) == 1
    assert not os.path.exists(tmp_path / "out") and not _staging_left(tmp_path / "out")


def _replace_repeatedly(path, writer, rounds, start):
    """One job's saves to `path`: each stages a complete directory (two files that name the same
    writer and round) and replaces `path` with it."""
    from fsdpturbo.staging import new_staging, replace

    start.wait()
    for n in range(rounds):
        staging = new_staging(path)
        for name in ("a", "b"):
            with open(os.path.join(staging, name), "w") as f:
                f.write(f"{writer} {n}")
        replace(staging, path, ours=_written_by_a_job, overwrite=False, hint="ours")


def _written_by_a_job(directory):
    return os.path.isfile(os.path.join(directory, "a"))


def test_two_jobs_replacing_one_path_leave_one_whole_copy(tmp_path):
    """Two processes (two training jobs pointed at one directory) replace the same path 100
    times each, concurrently: every replace succeeds, and what stands at the end is one whole
    output of one writer, with nothing moved aside left behind."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    path, rounds = os.fspath(tmp_path / "ckpt"), 100
    start = ctx.Barrier(2)
    jobs = [ctx.Process(target=_replace_repeatedly, args=(path, w, rounds, start)) for w in ("x", "y")]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(timeout=300)
    assert [job.exitcode for job in jobs] == [0, 0]
    contents = {open(os.path.join(path, name)).read() for name in ("a", "b")}
    assert contents in ({f"x {rounds - 1}"}, {f"y {rounds - 1}"})
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_what_appears_at_the_path_during_a_save_is_kept(tmp_path):
    """The path is checked again, under the lock, when the staged directory replaces it: a
    directory that is not ours created there after the save began stays, and the save fails."""
    from fsdpturbo.staging import check_target, new_staging, replace

    path = os.fspath(tmp_path / "ckpt")
    check_target(path, ours=_written_by_a_job, overwrite=False, hint="ours")
    staging = new_staging(path)
    with open(os.path.join(staging, "a"), "w") as f:
        f.write("staged")
    os.mkdir(path)
    with open(os.path.join(path, "train.log"), "w") as f:
        f.write("someone else's")
    with pytest.raises(FileExistsError, match=r"'.*ckpt' exists and is not ours"):
        replace(staging, path, ours=_written_by_a_job, overwrite=False, hint="ours")
    assert os.listdir(path) == ["train.log"]
    replace(staging, path, ours=_written_by_a_job, overwrite=True, hint="ours")
    assert os.listdir(path) == ["a"] and sorted(os.listdir(tmp_path)) == ["ckpt"]
