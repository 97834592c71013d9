"""The fast path on by default: what ``"auto"`` resolves to and why, the Trainer integration
(same training as ``transformers.Trainer``, checkpoints and resume, TRL), and on a GPU that
the defaults take the fast path and train like the plain model."""

from __future__ import annotations

import copy
import logging
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from polyaccel.moe import AutoModelForCausalLM, BackendConfig, FlatAdamW, fast_path
from polyaccel.moe.config import compiles_layers
from polyaccel.moe.graphed_step import overwritten_params
from polyaccel.moe.presets import mixtral_8x7b, olmoe_1b_7b, qwen3_30b_a3b, tiny
from polyaccel.moe.train import finetune
from polyaccel.moe.train_config import load_config

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "packages/moe/examples/tiny_synthetic_cpu.yaml"


# --------------------------------------------------------------------------------------------
# What "auto" resolves to
# --------------------------------------------------------------------------------------------

def test_compile_auto_means_cuda_only():
    assert BackendConfig().compile == "auto"
    auto, on, off = BackendConfig(), BackendConfig(compile=True), BackendConfig(compile=False)
    assert compiles_layers(auto, "cuda") and not compiles_layers(auto, "cpu")
    assert compiles_layers(on, "cpu") and not compiles_layers(off, "cuda")
    with pytest.raises(ValueError, match="'auto', True or False"):
        BackendConfig(compile="yes")


def test_auto_window_fits_the_memory_share():
    """The window gathers ~1024 rows per expert within WINDOW_MEMORY_SHARE of the device: the
    8-layer Qwen3 shape (256 rows, 2.3 GB per deferred micro-batch) gets all 4 micro-batches on
    an H200, OLMoE's 16 layers (512 rows, 5.4 GB each) two, and a small device none."""
    h200 = 141 * 10**9
    per = fast_path.kept_bytes_per_micro_batch(qwen3_30b_a3b(8), 4096)
    assert per == 2 * 8 * (3 * 768 + 2048) * 4096 * 8
    assert fast_path.auto_window(qwen3_30b_a3b(8), tokens_per_micro_batch=4096, grad_accum=4, device_bytes=h200) == 4
    assert fast_path.auto_window(olmoe_1b_7b(), tokens_per_micro_batch=4096, grad_accum=4, device_bytes=h200) == 2
    # Mixtral's 8 experts already see 1024 rows each in one micro-batch: no window.
    assert fast_path.auto_window(mixtral_8x7b(4), tokens_per_micro_batch=4096, grad_accum=4, device_bytes=h200) == 1
    assert fast_path.auto_window(mixtral_8x7b(4), tokens_per_micro_batch=1024, grad_accum=4, device_bytes=h200) == 4
    assert fast_path.auto_window(qwen3_30b_a3b(8), tokens_per_micro_batch=4096, grad_accum=4,
                                 device_bytes=16 * 10**9) == 1
    assert fast_path.auto_window(qwen3_30b_a3b(8), tokens_per_micro_batch=4096, grad_accum=1, device_bytes=h200) == 1


def test_moe_layer_count_skips_dense_layers():
    assert fast_path.moe_layer_count(tiny("qwen3_moe")) == 2  # 3 layers, mlp_only_layers=[1]
    assert fast_path.moe_layer_count(tiny("deepseek_v3")) == 2  # first_k_dense_replace=1


def test_plan_says_why_once(caplog):
    fast_path._SAID.clear()
    kwargs = dict(model_config=tiny("qwen3_moe"), device=torch.device("cuda", 0), cuda_graph="auto",
                  wgrad_window=1, fsdp=True, optimizer="auto", activation_checkpointing=True,
                  fused_grad_accumulation=True, tokens_per_micro_batch=64, grad_accum=2)
    with caplog.at_level(logging.WARNING, logger="polyaccel.moe.fast_path"):
        first = fast_path.plan(**kwargs)
        again = fast_path.plan(**kwargs)
    assert not first.cuda_graph and first.wgrad_window == 1 and first == again
    assert "FSDP2" in first.reasons[0] and "activation checkpointing" in first.reasons[0]
    assert sum("CUDA graph per micro-batch off" in r.message for r in caplog.records) == 1
    fp32 = fast_path.plan(**{**kwargs, "fsdp": False, "activation_checkpointing": False, "param_dtype": torch.float32})
    assert not fp32.cuda_graph and "reference GEMMs" in fp32.reasons[0]
    cpu = fast_path.plan(**{**kwargs, "device": torch.device("cpu"), "fsdp": False, "wgrad_window": "auto"})
    assert cpu == fast_path.FastPath(cuda_graph=False, wgrad_window=1, reasons=())
    explicit = fast_path.plan(**{**kwargs, "cuda_graph": False, "wgrad_window": 3})
    assert (explicit.cuda_graph, explicit.wgrad_window) == (False, 3)


def test_cpu_defaults_report_what_ran(tmp_path):
    cfg = load_config(TINY, [f"checkpoint.dir={tmp_path / 'ck'}", f"output_dir={tmp_path / 'out'}",
                             "log.progress_bar=false", "train.max_steps=2"])
    assert cfg.train.cuda_graph == "auto" and cfg.train.wgrad_window == "auto"
    result = finetune(cfg)
    assert result.fast_path == {"compiled_layers": False, "optimizer": "FlatAdamW", "cuda_graph": False,
                                "wgrad_window": 1, "attention": "sdpa"}
    assert result.summary()["fast_path"] == result.fast_path


# --------------------------------------------------------------------------------------------
# Trainer
# --------------------------------------------------------------------------------------------

def _model(seed: int = 0, arch: str = "qwen3_moe"):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny(arch), backend=BackendConfig(backend="cpu"),
                                            dtype=torch.float32)


def _data(n: int = 24, seq: int = 16):
    g = torch.Generator().manual_seed(3)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(3, 97, (n, seq), generator=g)]


def _args(out: Path, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4,
                learning_rate=3e-3, weight_decay=0.1, max_grad_norm=0.05, logging_steps=1, report_to=[],
                save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, optim="adamw_torch",
                lr_scheduler_type="linear", warmup_steps=1)
    return transformers.TrainingArguments(**{**base, **kw})


def _train(trainer_cls, args, model=None):
    model = model if model is not None else _model()
    trainer = trainer_cls(model=model, args=args, train_dataset=_data())
    trainer.train()
    return trainer, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _relative_gap(a: dict, b: dict, start: dict) -> float:
    """||a - b|| over how far b moved from start: 0 when a trains exactly like b, 1 when a stayed put."""
    num = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in b)
    den = sum(float((b[k] - start[k]).double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def test_trainer_trains_like_transformers_trainer(tmp_path):
    """polyaccel.moe.Trainer (FlatAdamW, clipping inside its pass) gives Transformers'
    Trainer's losses, grad norms and weights (clipping active: max_grad_norm below the norm)."""
    from polyaccel.moe import Trainer

    start = _model().state_dict()
    ours, w_ours = _train(Trainer, _args(tmp_path / "ours"))
    ref, w_ref = _train(transformers.Trainer, _args(tmp_path / "ref"))
    assert isinstance(ours.flat_optimizer(), FlatAdamW) and ref.optimizer.optimizer.__class__ is torch.optim.AdamW
    hist = lambda t, k: [h[k] for h in t.state.log_history if k in h]  # noqa: E731
    assert min(hist(ref, "grad_norm")) > 0.05  # clipping did something
    torch.testing.assert_close(hist(ours, "loss"), hist(ref, "loss"), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hist(ours, "grad_norm"), hist(ref, "grad_norm"), rtol=1e-4, atol=1e-5)
    assert _relative_gap(w_ours, w_ref, start) < 1e-4
    # Negative control: a run that does not train is far from the reference by this measure.
    _, w_still = _train(Trainer, _args(tmp_path / "still", learning_rate=0.0))
    assert _relative_gap(w_still, w_ref, start) > 0.5


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _nan_once(base: type) -> type:
    """``base`` whose third micro-batch reports a NaN loss (back-propagating the real one)."""

    class NanOnce(base):
        calls = 0

        def compute_loss(self, model, inputs, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            type(self).calls += 1
            return loss + torch.tensor(float("nan")) if type(self).calls == 3 else loss

    return NanOnce


def test_trainer_filters_a_nan_loss_on_the_device_like_transformers(tmp_path):
    """With ``logging_nan_inf_filter`` (Trainer's default) a NaN micro-batch loss is replaced by
    the average since the last log, on the device: the logged losses equal Transformers'
    Trainer's (which checks each micro-batch with a host sync), Trainer's own check is off
    while training (so it never syncs) and the user's setting is back afterwards; with the
    filter off the NaN is logged, as Transformers does."""
    from polyaccel.moe import Trainer

    seen = []

    class Watch(transformers.TrainerCallback):
        def on_substep_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003, ANN201
            seen.append(args.logging_nan_inf_filter)

    for nan_filter in (True, False):
        ours = _nan_once(Trainer)(model=_model(), train_dataset=_data(), callbacks=[Watch()],
                                  args=_args(tmp_path / f"o{nan_filter}", logging_nan_inf_filter=nan_filter,
                                             save_strategy="steps", save_steps=2))
        ours.train()
        ref = _nan_once(transformers.Trainer)(model=_model(), train_dataset=_data(),
                                              args=_args(tmp_path / f"r{nan_filter}", logging_nan_inf_filter=nan_filter))
        ref.train()
        got, want = _losses(ours), _losses(ref)
        assert len(got) == len(want) == 4 and any(map(torch.isnan, map(torch.tensor, want))) != nan_filter
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-6, equal_nan=True)
        assert ours.args.logging_nan_inf_filter is nan_filter
        for step in (2, 4):  # a checkpoint written mid-run records the setting as given
            saved = torch.load(tmp_path / f"o{nan_filter}" / f"checkpoint-{step}" / "training_args.bin",
                               weights_only=False)
            assert saved.logging_nan_inf_filter is nan_filter
    assert seen[:4] == [False] * 4  # Trainer's own check was off while the filter ran on the device
    ours.args.logging_nan_inf_filter = True
    nan = torch.tensor(float("nan"))
    assert ours._filter_loss(nan) is nan and ours.args.logging_nan_inf_filter  # outside train(): untouched


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3"])
def test_trainer_checkpoint_resume_matches_straight_run(tmp_path, arch):
    """Save at step 2 of 4, resume into another init: the losses after the resume, the final
    weights, FlatAdamW's state and the LR equal the uninterrupted run's; every ``.pt``/``.pth``
    of the checkpoint loads with plain ``torch.load(weights_only=True)`` (no NumPy allow-list)."""
    import numpy as np

    from polyaccel.moe import Trainer

    straight_trainer, straight = _train(Trainer, _args(tmp_path / "a"), _model(arch=arch))
    args = _args(tmp_path / "b", save_strategy="steps", save_steps=2)
    first = Trainer(model=_model(arch=arch), args=args, train_dataset=_data())
    first.train()
    ckpt = tmp_path / "b" / "checkpoint-2"
    assert (ckpt / "optimizer.pt").is_file()
    files = {f.name: torch.load(f, weights_only=True) for f in [*ckpt.glob("*.pt"), *ckpt.glob("*.pth")]}
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth"} <= files.keys()
    np.random.set_state(files["rng_state.pth"]["numpy"])  # NumPy takes the tensor form back
    resumed_model = _model(seed=1, arch=arch)  # other init: everything must come from the checkpoint
    resumed = Trainer(model=resumed_model, args=args, train_dataset=_data())
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert _losses(resumed) == _losses(straight_trainer)
    assert resumed.lr_scheduler.get_last_lr() == straight_trainer.lr_scheduler.get_last_lr()
    final = resumed_model.state_dict()
    for k in straight:
        torch.testing.assert_close(final[k], straight[k], rtol=1e-5, atol=1e-6, msg=k)
    want, got = straight_trainer.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert want.keys() == got.keys()
    for i in want:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got[i][name], want[i][name], rtol=1e-5, atol=1e-7)


def test_trainer_clipping_with_a_loss_scaler_is_trainers_own(tmp_path, monkeypatch):
    """With fp16's GradScaler the gradients are scaled by the loss scale until Trainer's own
    clipping unscales them: the FlatAdamW shortcut would measure the scaled norm, so it steps
    aside for Trainer's path then."""
    from polyaccel.moe import Trainer

    trainer = Trainer(model=_model(), args=_args(tmp_path), train_dataset=_data())
    trainer.create_optimizer()
    monkeypatch.setattr(transformers.Trainer, "_clip_grad_norm", lambda self, model: "trainer's own")
    assert trainer.accelerator.scaler is None and trainer._clip_grad_norm(trainer.model) != "trainer's own"
    monkeypatch.setattr(trainer.accelerator, "scaler", object())
    assert trainer._clip_grad_norm(trainer.model) == "trainer's own"


def test_trainer_keeps_other_optimizers(tmp_path):
    from polyaccel.moe import Trainer

    trainer, _ = _train(Trainer, _args(tmp_path, optim="sgd", max_steps=1))
    assert trainer.flat_optimizer() is None and isinstance(trainer.optimizer.optimizer, torch.optim.SGD)


def _word_tokenizer():
    """A 97-word offline tokenizer matching the tiny models' vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(97)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2", unk_token="t0")


def test_fast_trainer_class_wraps_sft_trainer(tmp_path):
    trl = pytest.importorskip("trl")
    from polyaccel.moe import fast_trainer_class

    cls = fast_trainer_class(trl.SFTTrainer)
    assert cls is fast_trainer_class(trl.SFTTrainer) and issubclass(cls, trl.SFTTrainer)
    with pytest.raises(TypeError, match="not a transformers.Trainer"):
        fast_trainer_class(object)
    from datasets import Dataset

    data = Dataset.from_list([{"input_ids": d["input_ids"].tolist()} for d in _data()])
    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                         max_steps=3, learning_rate=3e-3, logging_steps=1, report_to=[], save_strategy="no",
                         use_cpu=True, disable_tqdm=True, optim="adamw_torch", dataset_kwargs={"skip_prepare_dataset": True})
    model = _model()
    before = copy.deepcopy(model.state_dict())
    trainer = cls(model=model, args=args, train_dataset=data, processing_class=_word_tokenizer())
    trainer.train()
    assert isinstance(trainer.flat_optimizer(), FlatAdamW)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    # save at step 2, resume into another init: TRL's run continues like the straight one
    args.save_strategy, args.save_steps, args.output_dir = "steps", 2, str(tmp_path / "ck")
    cls(model=_model(), args=args, train_dataset=data, processing_class=_word_tokenizer()).train()
    resumed_model = _model(seed=1)
    resumed = cls(model=resumed_model, args=args, train_dataset=data, processing_class=_word_tokenizer())
    resumed.train(resume_from_checkpoint=str(tmp_path / "ck" / "checkpoint-2"))
    assert _losses(resumed) == losses
    for k, v in model.state_dict().items():
        torch.testing.assert_close(resumed_model.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)


# --------------------------------------------------------------------------------------------
# GPU: the defaults take the fast path and train like the plain model
# --------------------------------------------------------------------------------------------

def _final_weights(d: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update({k: v.double() for k, v in load_file(f).items()})
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_defaults_take_the_fast_path_and_train_like_plain(tmp_path):
    """On CUDA, the example config with no speed flags compiles its layers and runs FlatAdamW,
    a CUDA graph per micro-batch and a weight-gradient window; after 6 steps its weights equal
    the plain configuration's (eager layers, torch AdamW, no graph, no window). Negative
    control: the same measure puts an lr=0 run far away."""
    common = ["train.device=cuda", "train.dtype=bf16", "train.max_steps=6", "train.grad_accum=4",
              "train.micro_batch=1", "checkpoint.dir=null", "log.progress_bar=false", "train.grad_clip=0.5"]

    def run(name: str, *extra: str):
        cfg = load_config(TINY, [*common, f"output_dir={tmp_path / name}", *extra])
        return finetune(cfg), _final_weights(tmp_path / name)

    fast, w_fast = run("fast")
    assert fast.fast_path == {"compiled_layers": True, "optimizer": "FlatAdamW", "cuda_graph": True,
                              "wgrad_window": 4}
    plain, w_plain = run("plain", "model.backend.compile=false", "train.optimizer=adamw",
                         "train.cuda_graph=false", "train.wgrad_window=1")
    assert plain.fast_path["cuda_graph"] is False and plain.fast_path["compiled_layers"] is False
    _, w_start = run("start", "train.lr=0")
    torch.testing.assert_close(torch.tensor(fast.losses), torch.tensor(plain.losses), rtol=2e-2, atol=2e-2)
    # bf16 sums in another order (graph, window, compiled kernels): well within what training moved.
    assert _relative_gap(w_fast, w_plain, w_start) < 0.2
    assert _relative_gap(w_start, w_plain, w_start) > 0.5  # negative control: lr=0
    fp32, _ = run("fp32", "train.dtype=fp32")  # the per-expert reference syncs: no graph, said why
    assert fp32.fast_path["cuda_graph"] is False and fp32.fast_path["compiled_layers"] is True


@pytest.mark.parametrize("with_num_items", [False, True])
def test_graphed_micro_step_loss_is_what_trainer_back_propagates(tmp_path, with_num_items):
    """The loss the Trainer's CUDA-graphed micro-step back-propagates (``_graph_loss``, run on
    CPU here) is ``transformers.Trainer.training_step``'s: divided by the gradient-accumulation
    steps without ``num_items_in_batch``, the sum over the step's target count with it."""
    from polyaccel.moe import Trainer

    model = _model()
    trainer = Trainer(model=model, args=_args(tmp_path, gradient_accumulation_steps=4), train_dataset=_data())
    trainer.current_gradient_accumulation_steps = 4
    batch = {"input_ids": torch.stack([d["input_ids"] for d in _data()[:2]])}
    batch["labels"] = batch["input_ids"].clone()
    n_items = torch.tensor(97.0) if with_num_items else None
    expected = transformers.Trainer.training_step(trainer, model, dict(batch), num_items_in_batch=n_items)
    extra = {"num_items_in_batch": n_items} if with_num_items else {}
    ours = trainer._graph_loss(model, **batch, **extra)
    torch.testing.assert_close(ours.detach(), expected, rtol=1e-6, atol=1e-7)
    plain = model(**batch).loss.detach()
    assert not torch.allclose(expected, plain)  # the scaling is really exercised


def test_graph_needs_cuda_and_nothing_else_when_all_fits():
    """Every requirement met on a CUDA device: graphed, no reasons; the same on the CPU: not
    graphed (CUDA graphs need CUDA), silently. Sparse-step models count only their MoE layers."""
    kwargs = dict(model_config=tiny("qwen3_moe"), device=torch.device("cuda", 0), cuda_graph="auto",
                  wgrad_window=1, fsdp=False, optimizer="flat_adamw", activation_checkpointing=False,
                  fused_grad_accumulation=True, tokens_per_micro_batch=64, grad_accum=2)
    assert fast_path.plan(**kwargs) == fast_path.FastPath(cuda_graph=True, wgrad_window=1, reasons=())
    cpu = fast_path.plan(**{**kwargs, "device": torch.device("cpu")})
    assert cpu == fast_path.FastPath(cuda_graph=False, wgrad_window=1, reasons=())
    assert fast_path.graph_blockers(device=torch.device("cpu"), fsdp=False, optimizer="flat_adamw",
                                    activation_checkpointing=False) == ["it needs a CUDA device"]
    # decoder_sparse_step=2 over 4 layers: layers 1 and 3 hold experts (Transformers' rule).
    assert fast_path.moe_layer_count(tiny("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[],
                                          decoder_sparse_step=2)) == 2
    assert fast_path.moe_layer_count(tiny("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[3],
                                          decoder_sparse_step=2)) == 1


def _graph_forced_on_cpu(monkeypatch, off_from_call: int | None = None) -> None:
    """Let the Trainer take its graphed micro-step on the CPU (it runs the same arithmetic
    eagerly there); with ``off_from_call``, the blockers turn up from that call on."""
    calls = []

    def blockers(**kwargs):  # noqa: ANN003, ANN202
        calls.append(kwargs)
        return ["off for this test"] if off_from_call is not None and len(calls) >= off_from_call else []

    monkeypatch.setattr(fast_path, "graph_blockers", blockers)


@pytest.mark.parametrize("graph_kept", [True, False])
def test_trainer_leaves_overwritten_expert_grads_to_the_micro_step(tmp_path, monkeypatch, graph_kept):
    """With the graphed micro-step planned when the optimizer is made, FlatAdamW does not zero
    the expert gradients that micro-step writes over at each step's first micro-batch, and the
    run trains like transformers.Trainer; when the micro-step then does not run (blockers found
    at the first micro-batch), FlatAdamW zeroes them again."""
    from polyaccel.moe import Trainer

    _graph_forced_on_cpu(monkeypatch, off_from_call=None if graph_kept else 2)
    start = _model().state_dict()
    ours, w_ours = _train(Trainer, _args(tmp_path / "ours"))
    opt = ours.flat_optimizer()
    skipped = sum(f.param.numel() - f.zero_end for flats in opt._flats for f in flats)
    expert_numel = sum(p.numel() for p in overwritten_params(ours.model))
    assert expert_numel > 0
    if graph_kept:
        assert ours._micro_step is not None and skipped >= expert_numel
    else:
        assert ours._micro_step is None and skipped == 0
    ref, w_ref = _train(transformers.Trainer, _args(tmp_path / "ref"))
    hist = lambda t: [h["loss"] for h in t.state.log_history if "loss" in h]  # noqa: E731
    torch.testing.assert_close(hist(ours), hist(ref), rtol=1e-5, atol=1e-5)
    assert _relative_gap(w_ours, w_ref, start) < 1e-4


def test_trainer_resume_true_skips_a_checkpoint_a_kill_cut_off(tmp_path, caplog):
    """A kill during Trainer's save of ``checkpoint-N`` leaves it without ``trainer_state.json``
    (written last); ``resume_from_checkpoint=True`` took it as the newest and failed
    (``FileNotFoundError``). It now resumes from the newest complete one, with a warning, and
    ends where the uninterrupted run ends."""
    from polyaccel.moe import Trainer

    _, straight = _train(Trainer, _args(tmp_path / "a", max_steps=6))
    args = _args(tmp_path / "b", max_steps=6, save_strategy="steps", save_steps=2)
    Trainer(model=_model(), args=args, train_dataset=_data()).train()
    shutil.rmtree(tmp_path / "b" / "checkpoint-6")
    (tmp_path / "b" / "checkpoint-4" / "trainer_state.json").unlink()  # the save the kill cut off
    resumed_model = _model(seed=1)
    resumed = Trainer(model=resumed_model, args=args, train_dataset=_data())
    resumed.train(resume_from_checkpoint=True)
    assert f"{tmp_path / 'b' / 'checkpoint-4'} has no trainer_state.json" in caplog.text
    final = resumed_model.state_dict()
    for k in straight:
        torch.testing.assert_close(final[k], straight[k], rtol=1e-5, atol=1e-6, msg=k)


def test_the_newest_complete_checkpoint_counts_steps_as_numbers(tmp_path):
    from polyaccel.moe.trainer import newest_complete_checkpoint

    assert newest_complete_checkpoint(tmp_path) is None
    for name in ("checkpoint-9", "checkpoint-10", "checkpoint-11", "checkpoint-12x"):
        (tmp_path / name).mkdir()
    for name in ("checkpoint-9", "checkpoint-10", "checkpoint-12x"):
        (tmp_path / name / "trainer_state.json").write_text("{}")
    assert newest_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")
    (tmp_path / "checkpoint-11" / "trainer_state.json").write_text('{"best_metric": nu')  # the write a kill cut
    assert newest_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")
