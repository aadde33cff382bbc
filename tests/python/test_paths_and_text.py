"""Paths and text from files: a safetensors index may name only regular files inside its
checkpoint directory (`../x`, an absolute path, a FIFO are refused, nothing outside is read,
nothing blocks); text echoed into errors is escaped and read whole (a NUL once cut the message,
a newline forged a log line); a text result of the library is read again when it grew between
the size and the copy (a registration on another thread)."""
import ctypes
import json
import os
import signal

import pytest
import torch
from safetensors.torch import save_file
from models import build_model



@pytest.fixture
def no_hang():
    """Fails the test instead of hanging it (a FIFO opened for reading waits for a writer)."""
    def expire(*_):
        raise TimeoutError("blocked for 20 s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _index(directory, files):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {f"w{i}": name for i, name in enumerate(files)}}))


@pytest.mark.parametrize("entry", ["../elsewhere/planted.safetensors", "/etc/hostname", "sub/../../x.safetensors"])
def test_index_entries_outside_the_directory_are_refused(tmp_path, entry):
    from fsdpturbo import convert, load_hf_weights

    (tmp_path / "elsewhere").mkdir()
    save_file({"w0": torch.full((4,), 7.0)}, tmp_path / "elsewhere" / "planted.safetensors")
    _index(tmp_path / "model", [entry])
    model = torch.nn.Linear(2, 2)
    for load in (lambda: load_hf_weights(model, tmp_path / "model"),
                 lambda: convert.hf_to_dcp(str(tmp_path / "model"), str(tmp_path / "out"))):
        with pytest.raises(ValueError, match=rf"names the file {entry!r}, which is not inside"):
            load()
    assert not os.path.exists(tmp_path / "out")


def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(tmp_path, no_hang):
    from fsdpturbo import load_hf_weights
    from fsdpturbo.weights import checkpoint_fingerprint

    _index(tmp_path / "model", ["model-1.safetensors"])
    os.mkfifo(tmp_path / "model" / "model-1.safetensors")
    os.mkfifo(tmp_path / "fifo.safetensors")
    model = torch.nn.Linear(2, 2)
    for load in (lambda: load_hf_weights(model, tmp_path / "model"),
                 lambda: checkpoint_fingerprint(tmp_path / "model"),
                 lambda: load_hf_weights(model, tmp_path / "fifo.safetensors")):
        with pytest.raises((ValueError, FileNotFoundError), match="not a regular file|neither a safetensors file"):
            load()


def test_links_inside_the_directory_still_load(tmp_path):
    """The Hugging Face cache: snapshots/<rev>/model.safetensors links to ../../blobs/<hash>."""
    from fsdpturbo import load_hf_weights

    model = build_model("qwen3_moe")
    model.save_pretrained(tmp_path / "blobs")
    (tmp_path / "snapshot").mkdir()
    for name in os.listdir(tmp_path / "blobs"):
        os.symlink(os.path.join("..", "blobs", name), tmp_path / "snapshot" / name)
    assert len(load_hf_weights(build_model("qwen3_moe", seed=1), tmp_path / "snapshot")) > 0


def _header_file(path, name):
    header = json.dumps({name: {"dtype": "X", "shape": [1], "data_offsets": [0, 1]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + b"\0")


@pytest.mark.parametrize("name", ["w\n2026-12-06 12:00:00 INFO fsdpturbo: checkpoint verified OK", "a\0forged",
                                  "a\u2028forged", "a\u202eforged"])
def test_a_tensor_name_is_escaped_and_kept_whole_in_the_error(tmp_path, name):
    from fsdpturbo import load_hf_weights

    _header_file(tmp_path / "model.safetensors", name)
    with pytest.raises(ValueError) as raised:
        load_hf_weights(torch.nn.Linear(2, 2), tmp_path)
    text = str(raised.value)
    assert "forged" in text or "verified OK" in text, f"the message was cut: {text!r}"
    assert text.isprintable(), f"raw control, separator or bidi characters in {text!r}"


def test_last_error_reads_the_whole_buffer(monkeypatch):
    from fsdpturbo import _native

    message = b"tensor `a\0b`: what follows the NUL"

    class Library:
        @staticmethod
        def fsdpturbo_last_error(buf, length):
            if buf is not None:
                ctypes.memmove(buf, message, min(len(message), length - 1))
            return len(message)

    monkeypatch.setattr(_native, "lib", Library)
    assert _native.last_error() == message.decode()


def test_string_out_retries_when_the_text_grew_in_between():
    from fsdpturbo import _native

    texts = iter([b"short", b"grown between the two calls", b"grown between the two calls"])

    def text_out(buf, capacity, out_len):
        text = next(texts) + b"\0"
        out_len._obj.value = len(text)
        if len(text) > capacity:
            return _native.BUFFER_TOO_SMALL
        ctypes.memmove(buf, text, len(text))
        return _native.OK

    assert _native.string_out(text_out) == "grown between the two calls"


def test_the_headers_of_a_checkpoint_have_a_budget(tmp_path, monkeypatch):
    """Every header is parsed and kept while loading: their total is bounded (limit lowered here)."""
    from fsdpturbo import load_hf_weights, weights

    build_model("qwen3_moe").save_pretrained(tmp_path, max_shard_size="20KB")
    sizes = [os.path.getsize(f) for f in weights.checkpoint_files(tmp_path)]
    assert len(sizes) > 2
    monkeypatch.setattr(weights, "MAX_HEADER_BYTES", 1000)
    with pytest.raises(ValueError, match=r"the headers of checkpoint .* hold \d+ bytes by .*, more than the limit "
                                         r"of 1000"):
        load_hf_weights(build_model("qwen3_moe"), tmp_path)
