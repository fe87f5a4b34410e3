"""A prompt's prefill split over the context axis (8 fake CPU devices, a fresh process:
``split_prefill_run.py``): logits and KV cache equal the one-device prefill's, greedy
generation from it gives the same tokens, and the cache stays split while decoding."""

from __future__ import annotations

from pathlib import Path

import pytest

TOLERANCE = 5e-5
"""Split attention sums the same terms in another order (relative to the largest entry):
float32 through the layers and the vocabulary projection; an AMD EPYC's matmul library
gave 1.74e-5 on the logits where an Intel one stays under 1e-5 (a real error, a wrong
mask or position, is of the order of the entries themselves)."""
VARIANTS = ("ring", "all_gather")


@pytest.fixture(scope="module")
def runs(json_worker):
    return json_worker(Path(__file__).with_name("split_prefill_run.py"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_split_prefill_equals_one_device(runs, variant):
    """A 37-token prompt (not a multiple of the 8 zig-zag chunks) padded into a 64-position
    cache, data 2 x context 4: the prompt's logits and every layer's keys and values (in
    true order) equal the unsplit prefill's."""
    run = runs[variant]
    for name in ("logits_error", "k_error", "v_error"):
        assert run[name] < TOLERANCE, (variant, name, run[name])


@pytest.mark.parametrize("variant", [*VARIANTS, "trainer_weights", "gpt2", "mixtral"])
def test_greedy_from_a_split_prefill_equals_one_device(runs, variant):
    """``sample_tokens(..., mesh=...)`` (``trainer_weights``: the ring Llama's weights split
    over the mesh by the parameter mapping, as a trainer leaves them, and GPT-2's copied
    whole to it, no ``mesh`` given; Mixtral: Llama's attention around its experts):
    8 greedy tokens after the prompt in a 60-position buffer (split: rounded up to 64; GPT-2's
    learned positions past its table are padding) are those of the unsplit prefill, and they
    are not one token repeated."""
    run = runs[variant]
    assert run["split_prefills"] == 1  # it did split
    assert run["split_tokens"] == run["unsplit_tokens"]
    assert len(run["split_tokens"]) == 37 + 8 and len(set(run["split_tokens"][37:])) > 2


@pytest.mark.parametrize("variant", VARIANTS)
def test_padding_is_never_attended(runs, variant):
    """The positions after the prompt filled with random tokens instead of zeros (27 in the
    64-position prefill; 23 of the 60-position buffer, then the rounding's zeros):
    the prompt's logits are bitwise the same (no prompt position sees them), and so are the
    greedy tokens (a decode step overwrites its slot before any query can see it)."""
    run = runs[variant]
    assert run["garbage_pad_logits_diff"] == 0.0
    assert run["garbage_pad_tokens"] == run["split_tokens"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_cache_stays_split_while_decoding(runs, variant):
    """The cache comes out of the prefill split over ``context`` along its positions, a
    decode step keeps it so, and the compiled step has no all-gather: GSPMD reduces the
    softmax across the devices instead (three all-reduces in the layer scan's body: the
    scores' max, their sum and the output, one token's worth each)."""
    run = runs[variant]
    assert run["cache_position_spec"] == "context"
    assert run["stepped_cache_position_spec"] == "context"
    assert run["decode_collectives"] == {"all-gather": 0, "all-reduce": 3}


def test_bench_runs_at_small_size(runs):
    """bench/split_prefill.py (its 16,384-position figures are in bench/README.md) at 256
    positions: each case compiles and runs, and a split cache holds 1/8 of the positions
    per device at context 8, its prefill fewer temporaries than the unsplit one. Its
    ``main`` runs in the worker (8 fake devices, as the script's own)."""
    rows = {row["case"]: row for row in runs["bench"]["rows"]}
    assert set(rows) == {"no split", "one device forward", "ring", "all_gather"}
    whole = rows["no split"]
    for split in ("ring", "all_gather"):
        assert rows[split]["cache_mib_per_device"] == whole["cache_mib_per_device"] / 8
        assert rows[split]["prefill"]["temp_mib"] < whole["prefill"]["temp_mib"]
        assert rows[split]["decode_step_ms"] > 0


def test_sliding_window_is_refused(runs):
    """A split prefill is full causal, as training's split attention: a Mistral with a
    sliding window sampled on a context mesh is a ConfigError naming the key."""
    assert (
        "model.sliding_window is not supported when sampling with a split prompt"
        in (runs["window_error"])
    )
