"""`FinetuneOptions` and `SchemeSpec`: one place for the job's options, from which the
command line, `pj.finetune`'s keywords, `pockjax export --model`'s flags and `run.json`
are read; `--scheme` read once, before any model is."""
import argparse
import dataclasses
import inspect

import pytest

import pockjax as pj
from pockjax.finetuning import FinetuneOptions, SchemeSpec
from pockjax.finetuning._options import RESULT_OPTIONS
from pockjax.finetuning._run import run_options


def _parsed(*argv, job=False):
    p = argparse.ArgumentParser()
    FinetuneOptions.add_arguments(p, job=job)
    return FinetuneOptions.from_args(p.parse_args([str(a) for a in argv]), job=job)


def test_the_command_line_and_the_keywords_give_the_same_options():
    assert _parsed() == FinetuneOptions()
    flags = _parsed("--scheme", "last:2+head", "--epochs", "2.5", "--batch", "8", "--seq", "64",
                    "--lr", "3e-4", "--warmup", "5", "--schedule", "linear", "--weight-decay",
                    "0.1", "--eval-every", "7", "--save-every", "9", "--keep", "1",
                    "--resume", "--seed", "4", "--frozen-dtype", "int4:32", "--moments",
                    "int8", "--skip-nonfinite", "--frontend", "torch", "--no-plot",
                    "--prefix-cache", "off", "--save-dtype", "bfloat16", "--no-cache",
                    "--valid", "v.jsonl")
    keywords = FinetuneOptions(
        scheme="last:2+head", epochs=2.5, batch=8, seq=64, lr=3e-4, warmup=5,
        schedule="linear", weight_decay=0.1, eval_every=7, save_every=9, keep=1,
        resume=True, seed=4, frozen_dtype="int4:32", moments="int8", skip_nonfinite=True,
        frontend="torch", plot=False, prefix_cache="off", save_dtype="bfloat16",
        compile_cache=False, valid="v.jsonl")
    assert flags == keywords
    # Every field but the progress bar has its flag, and the defaults are the fields'.
    p = argparse.ArgumentParser()
    FinetuneOptions.add_arguments(p)
    dests = {a.dest for a in p._actions} - {"help"}
    assert dests == set(FinetuneOptions.names()) - {"progress"}
    with pytest.raises(SystemExit):  # --steps and --epochs exclude each other
        _parsed("--steps", "3", "--epochs", "1")


def test_export_takes_the_options_that_shape_the_step():
    job = FinetuneOptions.names(job=True)
    assert set(job) == {"scheme", "steps", "batch", "seq", "lr", "warmup", "schedule",
                        "weight_decay", "seed", "frozen_dtype", "moments", "frontend", "gguf_type"}
    assert _parsed("--steps", "10", "--lr", "1e-3", job=True) == FinetuneOptions(steps=10, lr=1e-3)
    p = argparse.ArgumentParser()
    FinetuneOptions.add_arguments(p, job=True)
    with pytest.raises(SystemExit):  # not a job option
        p.parse_args(["--resume"])


def test_finetune_signature_lists_the_options():
    params = inspect.signature(pj.finetune).parameters
    assert list(params)[:3] == ["model", "data", "out"]
    for field in dataclasses.fields(FinetuneOptions):
        assert params[field.name].default == field.default, field.name
        assert params[field.name].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("keywords, message", [
    (dict(steps=3, epochs=1), "give --steps or --epochs, not both"),
    (dict(batch=0), "--batch must be a positive whole number, got 0"),
    (dict(batch=2.0), "--batch must be a positive whole number, got 2.0"),
    (dict(keep=True), "--keep must be a positive whole number, got True"),
    (dict(seq=1), "--seq must be at least 2"),
    (dict(epochs=0), "--epochs must be positive"),
    (dict(lr=float("nan")), "--lr must be a positive finite number"),
    (dict(lr=0), "--lr must be a positive finite number"),
    (dict(warmup=-1), "--warmup must be a whole number >= 0"),
    (dict(weight_decay=float("inf")), "--weight-decay must be a finite number >= 0"),
    (dict(resume=True, overwrite=True), "give --resume or --overwrite, not both"),
    (dict(schedule="step"), "--schedule must be one of cosine, linear, constant"),
    (dict(moments="float8"), "--moments must be one of float32, bfloat16, int8"),
    (dict(frontend="jax"), "--frontend must be one of auto, flax, torch"),
    (dict(prefix_cache="yes"), "--prefix-cache must be one of auto, on, off"),
    (dict(scheme="lora:4", frozen_dtype="int8"), "--scheme lora:4 with --frozen-dtype int8"),
    (dict(scheme="last"), "choose one of paper, paper:K"),
    (dict(scheme="last:0"), "last:N takes a positive whole number"),
    (dict(scheme="blockwise:2:1:1"), "blockwise:K or blockwise:K:N"),
    (dict(scheme="full+head"), r"\+head follows paper, paper:K or last:N"),
])
def test_bad_options_are_refused_naming_the_flag(keywords, message):
    with pytest.raises(pj.FinetuneError, match=message):
        FinetuneOptions(**keywords)


def test_finetune_checks_options_before_reading_anything(tmp_path):
    # The model folder does not exist: the option is what the error names.
    with pytest.raises(pj.FinetuneError, match="blockwise:K or blockwise:K:N"):
        pj.finetune(tmp_path / "no-model", tmp_path / "no.jsonl", tmp_path / "out",
                    scheme="blockwise:1:2:3")
    assert not (tmp_path / "out").exists()
    with pytest.raises(TypeError, match="unexpected keyword argument 'step'; its options are"):
        pj.finetune(tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "out", step=3)
    with pytest.raises(pj.FinetuneError, match="as keywords or as options=, not both"):
        pj.finetune(tmp_path / "m", tmp_path / "d.jsonl", tmp_path / "out",
                    options=FinetuneOptions(), steps=3)


def test_the_scheme_is_read_once_into_a_value():
    spec = SchemeSpec.parse("paper:3+head")
    assert (spec.kind, spec.count, spec.head, str(spec)) == ("paper", 3, True, "paper:3+head")
    assert SchemeSpec.parse(spec) is spec
    assert FinetuneOptions(scheme=spec).scheme is spec
    assert FinetuneOptions(scheme="lora:8").scheme.lora_rank == 8
    assert SchemeSpec.parse("blockwise:5:2") == SchemeSpec("blockwise:5:2", "blockwise", 5, group=2)
    assert SchemeSpec.parse("search:40%").budget == "40%"
    assert not SchemeSpec.parse("search:4GiB").known_before_loading
    assert SchemeSpec.parse("runs/s.json").path.name == "s.json"


def test_run_json_records_the_options_that_change_what_a_run_computes():
    options = FinetuneOptions(scheme="last:1", steps=5, lr=1e-3, keep=1, plot=False)
    recorded = run_options(options, model="/m", data="abc", scheme="{...}", total_steps=5,
                           seq=32)
    assert list(recorded) == list(RESULT_OPTIONS)
    assert recorded["lr"] == 1e-3 and recorded["seq"] == 32 and recorded["scheme"] == "{...}"
    # Options that do not change the result (keep, plot, the cache) are not in it.
    assert not {"keep", "plot", "prefix_cache", "compile_cache", "resume"} & set(recorded)
    with pytest.raises(TypeError, match="no value for model"):
        run_options(seq=3)


def test_the_options_take_the_numbers_a_user_has_and_record_plain_ones():
    import json

    import numpy as np

    from pockjax.finetuning._options import MOMENTS
    from pockjax.optim.moments import MOMENTS as OPTIMIZER_MOMENTS

    assert MOMENTS == OPTIMIZER_MOMENTS  # --moments' choices are the optimizer's
    options = FinetuneOptions(batch=np.int64(8), seq=np.int32(64), lr=np.float32(0.5),
                              warmup=2.0, seed=np.uint8(3))
    assert (options.batch, options.seq, options.warmup, options.seed) == (8, 64, 2, 3)
    assert type(options.batch) is int and type(options.lr) is float
    recorded = run_options(options, model="/m", data="d", scheme="s", total_steps=1, seq=64)
    json.dumps(recorded)  # run.json takes them
    with pytest.raises(pj.FinetuneError, match="--warmup must be a whole number"):
        FinetuneOptions(warmup=2.5)


def test_a_non_finite_loss_is_one_error_that_pickles():
    import pickle

    import pockjax.train
    from pockjax.finetuning import NonFiniteLoss

    error = pickle.loads(pickle.dumps(NonFiniteLoss(7, float("nan"), "step 7: the loss is nan")))
    assert isinstance(error, pj.FinetuneError) and isinstance(error, pockjax.train.NonFiniteLoss)
    assert (error.step, str(error)) == (7, "step 7: the loss is nan")
    plain = pickle.loads(pickle.dumps(pockjax.train.NonFiniteLoss(2, float("inf"))))
    assert (plain.step, plain.loss, str(plain)) == (2, float("inf"), "step 2: the loss is inf")
