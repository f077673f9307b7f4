"""logitless.integrations.use_logitless on trainers: the Hugging Face Trainer and TRL's SFTTrainer and GRPOTrainer,
each run for a few steps on a tiny random-init Llama (with a character-level tokenizer built here: nothing is
downloaded), once as the library ships it and once with logitless, from the same seed. The logged loss, gradient
norm and every metric the trainer logs (SFT's mean_token_accuracy and entropy; GRPO's kl, entropy, clip ratios,
rewards) must agree to float32 rounding: the fused path computes what the trainer computes, without the logits.

Skips when transformers, trl or datasets is not importable (tools/test.sh installs them). The CUDA test skips
without a GPU.
Run: PYTHONPATH=build/<dir>/python python -m pytest tests/python/test_integrations.py -q
"""
import collections
import contextlib
import math
import warnings
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import logitless  # noqa: E402
from _helpers import needs_cuda  # noqa: E402
from logitless.integrations import LogitlessGRPOMixin, use_logitless  # noqa: E402

# Keys of the logs that are wall-clock measurements, not results.
TIMING = ("runtime", "per_second", "step_time", "total_flos")
CHARS = "abcdefghijklmnopqrstuvwxyz .,!?"
VOCAB = 96


def _tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    tokens = specials + list(CHARS)
    tokens += [f"<x{i}>" for i in range(VOCAB - len(tokens))]  # every id the model can sample decodes to something
    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                                bos_token="<bos>", unk_token="<unk>")


def _config(**extra):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                tie_word_embeddings=False)
    base.update(extra)
    return transformers.LlamaConfig(**base)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama and its tokenizer on disk: GRPO builds its reference model from the policy's path."""
    return _save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def _save_tiny_model(path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config())
    # Sixteen of the 96 ids end a generation (TRL reads the list from the generation config), so that GRPO's
    # completions come in different lengths and their masks matter.
    model.generation_config.eos_token_id = [1] + list(range(VOCAB - 15, VOCAB))
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return str(path)


def _load(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _common_args(tmp_path, **extra):
    args = dict(output_dir=str(tmp_path), max_steps=3, logging_steps=1, save_strategy="no", report_to="none",
                seed=0, data_seed=0, use_cpu=not extra.pop("cuda", False), disable_tqdm=True,
                dataloader_num_workers=0, learning_rate=1e-2, bf16=False)  # TRL's configs default to bf16
    args.update(extra)
    return args


@contextlib.contextmanager
def _calls():
    """Counts the calls of the fused ops (logitless's, TRL's own fused head) while training: the comparisons must
    be between two different paths."""
    import logitless.hf
    import logitless.integrations as integrations
    import trl.trainer.utils as trl_utils

    counts = collections.Counter()

    def counting(owner, name, key):
        fn = getattr(owner, name)

        def counted(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)

        return mock.patch.object(owner, name, counted)

    with counting(integrations, "linear_grpo_loss", "grpo"), \
            counting(integrations, "linear_selective_log_softmax", "logp"), \
            counting(integrations, "token_losses_uniform_grad", "sft_lce"), \
            counting(logitless.hf, "linear_cross_entropy", "lce"), \
            counting(trl_utils._ChunkedLogProbFunction, "apply", "trl"):
        yield counts


def _train(trainer):
    with _calls() as counts, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    trainer.fused_calls = dict(counts)
    return trainer


def _logs(trainer):
    out = []
    for entry in trainer.state.log_history:
        out.append({k: v for k, v in entry.items() if not any(t in k for t in TIMING)})
    return out


def _assert_logs_match(want, got, rtol=1e-4, atol=1e-5, required=()):
    assert len(want) == len(got) and want, (want, got)
    for step, (a, b) in enumerate(zip(want, got)):
        assert set(a) == set(b), f"step {step}: logged keys differ: {sorted(set(a) ^ set(b))}"
        for key in a:
            x, y = a[key], b[key]
            if isinstance(x, (int, float)) and not isinstance(x, bool):
                assert (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=rtol, abs_tol=atol), \
                    f"step {step}: {key}: {x} (trainer) vs {y} (logitless)"
            else:
                assert x == y, f"step {step}: {key}: {x!r} vs {y!r}"
    logged = set().union(*want)
    missing = [k for k in required if k not in logged]
    assert not missing, f"not logged: {missing} (of {sorted(logged)})"


# ----------------------------------------------------------------------------------------------------
# transformers.Trainer


def _lm_dataset(n=12, length=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (n, length), generator=g)
    labels = ids.clone()
    labels[::3, :4] = -100  # some rows with an ignored prefix
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * length] * n,
                                       "labels": labels.tolist()})


def _run_trainer(model_dir, tmp_path, fused, **extra):
    model = _load(model_dir)
    args = transformers.TrainingArguments(**_common_args(tmp_path, per_device_train_batch_size=4, **extra))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_lm_dataset())
    if fused:
        assert use_logitless(trainer) is trainer
        assert logitless.hf.is_patched(trainer.model)
    return _train(trainer)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_trainer_matches(model_dir, tmp_path, accumulation):
    # Plain SGD, so that the parameters differ by lr times the gradients' difference. Adam moves a parameter whose
    # gradient is near 0 by up to lr whatever its size, so there one rounding apart (float32 sums in another order)
    # could move it by 2e-4 (torch 2.15).
    want = _run_trainer(model_dir, tmp_path / "a", False, gradient_accumulation_steps=accumulation, optim="sgd")
    got = _run_trainer(model_dir, tmp_path / "b", True, gradient_accumulation_steps=accumulation, optim="sgd")
    _assert_logs_match(_logs(want), _logs(got), required=("loss", "grad_norm"))
    assert want.fused_calls == {} and got.fused_calls.get("lce", 0) >= 3
    for p, q in zip(want.model.parameters(), got.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_trainer_refuses_what_needs_logits(model_dir, tmp_path):
    model = _load(model_dir)
    args = transformers.TrainingArguments(**_common_args(tmp_path, label_smoothing_factor=0.1))
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_lm_dataset())
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        use_logitless(trainer)
    assert not logitless.hf.is_patched(model)


def test_model_and_wrapped_model(model_dir):
    model = _load(model_dir)
    compiled = torch.compile(model)
    assert use_logitless(compiled) is compiled
    assert logitless.hf.is_patched(model)
    ids = torch.randint(4, VOCAB, (2, 8))
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None
    logitless.unpatch(model)
    torch.testing.assert_close(out.loss, model(input_ids=ids, labels=ids).loss, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# SFTTrainer


def _sft_dataset(kind):
    g = torch.Generator().manual_seed(1)
    words = ["".join(CHARS[i] for i in torch.randint(0, 26, (int(n),), generator=g))
             for n in torch.randint(3, 12, (16,), generator=g)]
    if kind == "text":
        return datasets.Dataset.from_dict({"text": words})
    return datasets.Dataset.from_dict({"prompt": words[:8], "completion": words[8:]})


def _run_sft(model_dir, tmp_path, fused, kind="text", **extra):
    model = _load(model_dir)
    args = trl.SFTConfig(**_common_args(tmp_path, per_device_train_batch_size=4, max_length=32, **extra))
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=_sft_dataset(kind),
                             processing_class=_tokenizer())
    if fused:
        use_logitless(trainer)
    return _train(trainer)


@pytest.mark.parametrize("kind,extra", [("text", {}), ("prompt_completion", {"loss_type": "dft"}),
                                        ("text", {"gradient_accumulation_steps": 2}), ("text", {"bf16": True})],
                         ids=["text", "completion-only-dft", "accumulation", "bf16-autocast"])
def test_sft_matches(model_dir, tmp_path, kind, extra):
    want = _run_sft(model_dir, tmp_path / "a", False, kind, **extra)
    got = _run_sft(model_dir, tmp_path / "b", True, kind, **extra)
    # Under bf16 autocast TRL rounds each logit to bf16 before its softmax; logitless does not: bf16's noise.
    tol = dict(rtol=1e-2, atol=1e-3) if extra.get("bf16") else {}
    _assert_logs_match(_logs(want), _logs(got), required=("loss", "grad_norm", "mean_token_accuracy", "entropy"),
                       **tol)
    assert want.fused_calls.get("trl", 0) >= 3 and "logp" not in want.fused_calls
    # nll: the linear cross-entropy with its gradient in the forward; dft: the selective log-softmax.
    path, other = ("logp", "sft_lce") if extra.get("loss_type") == "dft" else ("sft_lce", "logp")
    assert got.fused_calls.get(path, 0) >= 3 and other not in got.fused_calls and "trl" not in got.fused_calls


def test_sft_fields_and_refusals(model_dir, tmp_path):
    trainer = _run_sft(model_dir, tmp_path, True, max_steps=1)
    model = trainer.model
    forward = model.forward
    assert use_logitless(trainer) is trainer and model.forward is forward  # a second call changes nothing
    with pytest.raises(TypeError, match="pass the trainer"):
        use_logitless(model)  # the cross-entropy patch would not serve TRL's fused_lm_head calls
    ids = torch.randint(4, VOCAB, (3, 9))
    labels = ids.clone()
    labels[0, :5] = -100
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    # The reference: the full logits, shifted, as TRL defines each field.
    logits = model(input_ids=ids).logits[:, :-1].float()
    target, mask = labels[:, 1:], labels[:, 1:] != -100
    logp = torch.log_softmax(logits, -1)
    want_logp = logp.gather(-1, target.clamp(min=0)[..., None])[..., 0] * mask
    want_entropy = -(logp.exp() * logp).sum(-1) * mask
    want_top1 = (logits.argmax(-1) == target) & mask
    torch.testing.assert_close(out.log_probs, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy, want_entropy, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.is_top1, want_top1) and torch.equal(out.label_mask, mask)
    out.loss.backward()  # the log-probs carry their gradient into the model
    assert model.lm_head.weight.grad is not None and model.model.embed_tokens.weight.grad is not None
    # Generation (no fused_lm_head) is the model's own forward.
    assert model.generate(ids[:1, :3], max_new_tokens=2, do_sample=False).shape == (1, 5)

    model = _load(model_dir)
    args = trl.SFTConfig(**_common_args(tmp_path, max_length=32, label_smoothing_factor=0.1))
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=_sft_dataset("text"),
                             processing_class=_tokenizer())
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        use_logitless(trainer)


# ----------------------------------------------------------------------------------------------------
# GRPOTrainer


def _vowels(completions, **kwargs):
    """A deterministic reward: the share of vowels in the completion."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


def _length(completions, **kwargs):
    return [len(text) / 8.0 for text in completions]


def _grpo_dataset():
    return datasets.Dataset.from_dict({"prompt": ["abc", "hello", "the cat", "go", "sun", "a b c", "xyz", "rain"]})


def _run_grpo(model_dir, tmp_path, fused, **extra):
    extra.setdefault("per_device_train_batch_size", 4)
    extra.setdefault("num_generations", 4)
    extra.setdefault("max_completion_length", 6)
    extra.setdefault("max_steps", 2)
    args = trl.GRPOConfig(**_common_args(tmp_path, **extra))
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=[_vowels, _length], args=args,
                              train_dataset=_grpo_dataset(), processing_class=_tokenizer())
    if fused:
        use_logitless(trainer)
        assert isinstance(trainer, LogitlessGRPOMixin) and isinstance(trainer, trl.GRPOTrainer)
    return _train(trainer)


GRPO_CASES = {
    # TRL's defaults: dapo, token level, beta 0, one update per generation (no old log-probs).
    "dapo": {},
    # KL to the reference model, two updates per generation (old log-probs, clipping), clip-higher.
    "grpo-kl-iterations": dict(loss_type="grpo", beta=0.1, use_bias_correction_kl=False, num_iterations=2,
                               epsilon_high=0.28, learning_rate=1e-2),
    # GSPO's sequence-level ratio, with bnpo and gradient accumulation.
    "bnpo-sequence-accumulation": dict(loss_type="bnpo", importance_sampling_level="sequence",
                                       per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                       num_iterations=2, learning_rate=3e-3),
    # TRL's float32 head (a no-op cast for a float32 model, but TRL's head forward is then its own function).
    "dr_grpo-temperature-fp32-head": dict(loss_type="dr_grpo", temperature=0.7, beta=0.05, use_bias_correction_kl=False,
                                          cast_lm_head_to_fp32=True),
}


@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_grpo_matches(model_dir, tmp_path, case):
    extra = GRPO_CASES[case]
    want = _run_grpo(model_dir, tmp_path / "a", False, **extra)
    got = _run_grpo(model_dir, tmp_path / "b", True, **extra)
    required = ["loss", "grad_norm", "entropy", "reward", "clip_ratio/region_mean", "clip_ratio/high_max"]
    if extra.get("beta"):
        required.append("kl")
    _assert_logs_match(_logs(want), _logs(got), required=required)
    assert want.fused_calls.get("trl", 0) > 0 and not {"grpo", "logp"} & set(want.fused_calls)
    # The policy's loss by linear_grpo_loss; old-policy and reference log-probs (when the trainer needs them) by
    # linear_selective_log_softmax; TRL's own fused head never.
    assert got.fused_calls.get("grpo", 0) >= 2 and "trl" not in got.fused_calls
    needs_logp = extra.get("beta") or extra.get("num_iterations", 1) > 1
    assert bool(got.fused_calls.get("logp")) == bool(needs_logp)


@pytest.mark.parametrize("option,value,words", [
    ("loss_type", "cispo", "loss_type='cispo'"),
    ("delta", 2.0, "delta=2.0"),
    ("beta", 0.1, "use_bias_correction_kl"),
    ("off_policy_mask_threshold", 0.5, "off_policy_mask_threshold"),
    ("top_entropy_quantile", 0.5, "top_entropy_quantile"),
    ("entropy_coef", 0.01, "entropy_coef"),
])
def test_grpo_refuses_unmapped_options(model_dir, tmp_path, option, value, words):
    args = trl.GRPOConfig(**_common_args(tmp_path, per_device_train_batch_size=4, num_generations=4,
                                         max_completion_length=4, **{option: value}))
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=_vowels, args=args, train_dataset=_grpo_dataset(),
                              processing_class=_tokenizer())
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("[", r"\[")):
        use_logitless(trainer)
    assert type(trainer) is trl.GRPOTrainer  # nothing changed
    assert "_logitless_trl" not in trainer.model.__dict__


def test_grpo_loss_against_trainer_formula(model_dir, tmp_path):
    """One batch through both _compute_loss implementations, with old and reference log-probs that differ from the
    policy's, so that the ratio clips and the KL is non-zero: the same loss and the same gradient of every
    parameter."""
    extra = dict(loss_type="grpo", beta=0.2, use_bias_correction_kl=False, epsilon_high=0.3, max_steps=1)
    trainer = _run_grpo(model_dir, tmp_path, True, **extra)
    g = torch.Generator().manual_seed(3)
    B, P, C = 4, 5, 6
    prompt_ids = torch.randint(4, VOCAB, (B, P), generator=g)
    completion_ids = torch.randint(4, VOCAB, (B, C), generator=g)
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[1, 4:] = 0
    inputs = dict(prompt_ids=prompt_ids, prompt_mask=torch.ones(B, P, dtype=torch.long), completion_ids=completion_ids,
                  completion_mask=completion_mask, advantages=torch.tensor([1.0, -0.5, 0.25, -1.5]),
                  old_per_token_logps=-4.6 + torch.randn(B, C, generator=g),
                  ref_per_token_logps=-4.6 + torch.randn(B, C, generator=g),
                  num_items_in_batch=completion_mask.sum())
    results = []
    for fn in (trl.GRPOTrainer._compute_loss, LogitlessGRPOMixin._compute_loss):
        trainer.model.zero_grad()
        for v in trainer._metrics["train"].values():
            v.clear()
        loss = fn(trainer, trainer.model, dict(inputs))
        loss.backward()
        metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if v}
        results.append((loss.detach(), [p.grad.clone() for p in trainer.model.parameters()], metrics))
    (l0, g0, m0), (l1, g1, m1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    assert set(m0) == set(m1) and m0["clip_ratio/region_mean"] > 0 and m0["kl"] > 0
    for k in m0:
        assert math.isclose(m0[k], m1[k], rel_tol=1e-4, abs_tol=1e-6), (k, m0[k], m1[k])


# ----------------------------------------------------------------------------------------------------
# CUDA: the same comparisons on the GPU (bf16 autocast on the fused path's operands)


@needs_cuda
def test_trainers_on_cuda(model_dir, tmp_path):
    want = _run_sft(model_dir, tmp_path / "a", False, cuda=True)
    got = _run_sft(model_dir, tmp_path / "b", True, cuda=True)
    _assert_logs_match(_logs(want), _logs(got), rtol=2e-3, atol=1e-4,
                       required=("loss", "mean_token_accuracy", "entropy"))
    want = _run_grpo(model_dir, tmp_path / "c", False, cuda=True, **GRPO_CASES["grpo-kl-iterations"])
    got = _run_grpo(model_dir, tmp_path / "d", True, cuda=True, **GRPO_CASES["grpo-kl-iterations"])
    _assert_logs_match(_logs(want), _logs(got), rtol=2e-3, atol=1e-4, required=("loss", "kl", "entropy"))
