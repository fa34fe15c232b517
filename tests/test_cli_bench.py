"""`localchat bench` as a user runs it, on a tiny random Llama (tests/llama_variants.py) at
q4f32_1: the JSON object's fields, the table's rows, the roofline's bytes against the model's
own tensor cache, progress on stderr, bad options as one error line, and Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fixtures import converted

LOCALCHAT = str(Path(sys.executable).with_name("localchat"))
SMALL = ["--prompt-tokens", "16", "--gen-tokens", "8"]
KEYS = {"model", "quantization", "device", "threads", "prompt_tokens", "prefill_tok_s", "ttft_s",
        "decode", "peak_rss_bytes", "load_s", "bandwidth_gb_s", "bytes_per_token",
        "roofline_fraction"}


@pytest.fixture(scope="module")
def model_dir() -> str:
    from llama_variants import build_variant

    path = converted(build_variant("llama-gqa"), "q4f32_1")
    # Compile here, once, so the bench processes below only load it.
    from localchat.engine.runtime import Model

    Model(path, "cpu")
    return str(path)


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LOCALCHAT, "bench", *args], capture_output=True, text=True,
                          timeout=timeout)


def errors(stderr: str) -> list[str]:
    """stderr without TVM's compile-time warnings."""
    return [line for line in stderr.splitlines() if line and "Warning:" not in line]


def test_json_has_every_field_with_plausible_values(model_dir: str) -> None:
    out = bench(model_dir, *SMALL, "--batch", "1,2", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)  # one object, nothing around it
    assert KEYS <= set(result)
    assert result["quantization"] == "q4f32_1" and result["device"].startswith("cpu")
    assert result["prompt_tokens"] == 16 and result["threads"] >= 1
    assert [d["batch"] for d in result["decode"]] == [1, 2]
    for name in ("prefill_tok_s", "ttft_s", "peak_rss_bytes", "load_s", "bandwidth_gb_s",
                 "bytes_per_token"):
        assert result[name] > 0, name
    assert all(d["tok_s"] > 0 for d in result["decode"])
    assert 0 < result["roofline_fraction"] < 1.5
    # the roofline's terms agree with each other
    first = result["decode"][0]["tok_s"]
    expected = result["bytes_per_token"] * first / (result["bandwidth_gb_s"] * 1e9)
    assert result["roofline_fraction"] == pytest.approx(expected)
    # progress went to stderr, one line per step
    lines = [line for line in errors(out.stderr) if line.startswith("bench: ")]
    assert any("prefill 16 tokens" in line for line in lines)
    assert any("decode 8 steps, batch 2" in line for line in lines)


def test_bytes_per_token_are_the_stored_weights_and_the_kv_cache(model_dir: str) -> None:
    """Every tensor of the model's tensor cache once (its untied input embedding one row: a
    lookup), plus the KV cache of one sequence at its mean length over the run (float16 in a
    quantized mode: 2 bytes a value)."""
    out = bench(model_dir, *SMALL, "--batch", "1", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    cache = json.loads((Path(model_dir) / "tensor-cache.json").read_text())
    stored = 0
    for shard in cache["records"]:
        for rec in shard["records"]:
            rows = rec["shape"][0] if rec["name"].startswith("model.embed_tokens.") else 1
            stored += rec["nbytes"] // rows
    meta = json.loads((Path(model_dir) / "localchat-config.json").read_text())
    config = meta["model_config"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_bytes = 2 if meta["quantization"].startswith("q4") else 4  # a float16 / float32 cache
    per_position = (2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
                    * kv_bytes)
    mean_length = 16 + 1 + (8 + 1) / 2  # prompt, the warm-up step, half the decode steps
    assert result["bytes_per_token"] == pytest.approx(stored + per_position * mean_length)


def test_the_table_has_a_row_per_batch(model_dir: str) -> None:
    out = bench(model_dir, *SMALL, "--batch", "1,2,3", "--threads", "1")
    assert out.returncode == 0, out.stderr
    rows = out.stdout.splitlines()
    assert "1 thread;" in rows[0] and "q4f32_1" in rows[0]
    decode = [r.split() for r in rows if r.strip().startswith("decode, batch")]
    assert [r[2] for r in decode] == ["1", "2", "3"] and all(r[-1] == "tok/s" for r in decode)
    for label in ("prefill", "time to first token", "peak memory (RSS)", "read bandwidth",
                  "bytes read per token", "of roofline", "load"):
        assert any(r.strip().startswith(label) for r in rows), label
    assert "bench:" not in out.stdout  # progress stays on stderr


@pytest.mark.parametrize(("args", "flag"), [
    (["--batch", "0"], "--batch"),
    (["--batch", "1,x"], "--batch"),
    (["--batch", "65"], "--batch"),
    (["--gen-tokens", "0"], "--gen-tokens"),
    (["--prompt-tokens", "0"], "--prompt-tokens"),
    (["--prompt-tokens", "500", "--gen-tokens", "100"], "--prompt-tokens"),  # window: 512
])
def test_bad_options_are_one_error_line(model_dir: str, args: list[str], flag: str) -> None:
    out = bench(model_dir, *args, timeout=120)
    assert out.returncode in (1, 2)
    lines = errors(out.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"localchat: error: {flag}"), out.stderr
    assert "Traceback" not in out.stderr and not out.stdout


def test_ctrl_c_stops_it_with_one_line(model_dir: str) -> None:
    # SIGINT at its default in the child: a shell starts background jobs with it ignored,
    # which Python then keeps (a suite run with `&` would see Ctrl+C do nothing)
    proc = subprocess.Popen([LOCALCHAT, "bench", model_dir, "--prompt-tokens", "16",
                             "--gen-tokens", "480", "--batch", "1,2,4,8,16,32,64"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # wait until it decodes
        seen.append(line)
        if "decode 480 steps" in line:
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, "".join(seen) + err
    assert "bench interrupted" in err and "Traceback" not in err and not out


def test_the_synthetic_prompt_is_exact_and_from_the_vocabulary() -> None:
    from localchat.engine.benchmark import synthetic_prompt

    ids = synthetic_prompt(512, 300, exclude=[0, 1, 2])
    assert len(ids) == 300 and all(3 <= t < 512 for t in ids)
    assert ids == synthetic_prompt(512, 300, exclude=[0, 1, 2])  # the same every run
    assert len(set(ids)) > 100
