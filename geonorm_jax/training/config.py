"""The one base config: every key any part of geonorm_jax reads is declared here (a
placement's own keys by its entry in placements.py, added to config.model below).

Sizes live in SIZES below and `get_config(arg)` applies them; the command-line files in
configs/ (`configs/tiny.py`, ...) call it. Nothing in the code uses `config.get(...)` with a default:
if a key is missing here, that is a bug.
"""
import ml_collections

from geonorm_jax.nn import placements


def get_base_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0  # params init; data order has its own seed so placements see the same batches

  model = config.model = ml_collections.ConfigDict()
  model.backbone = "gpt2"  # gpt2 | llama
  model.placement = "pre"  # see geonorm_jax.nn.placements.PLACEMENTS
  model.num_layers = 2
  model.d_model = 64
  model.num_heads = 4
  model.num_kv_heads = 0  # 0 -> same as num_heads (no grouped-query attention)
  model.d_ff = 0  # 0 -> 4*d_model (gpt2) or LLaMA's 8/3*d rounded to multiple_of
  model.ffn_multiple_of = 256  # LLaMA rounding of the SwiGLU hidden width
  model.vocab_size = 256
  model.max_seq_len = 128
  model.norm_kind = "auto"  # auto (layernorm for gpt2, rmsnorm for llama) | layernorm | rmsnorm
  model.norm_eps = 1e-5
  model.norm_gain = True  # learnable gain on every norm
  model.norm_bias = "auto"  # auto (bias iff layernorm on gpt2) | true | false
  model.tie_embeddings = "auto"  # auto (gpt2 tied, llama untied) | true | false
  model.rope_theta = 10000.0
  model.qk_norm = False  # RMSNorm on q and k (before RoPE), with any placement
  # What qk_norm normalises: head (each head's head_dim, one gain of head_dim shared by the
  # heads) | full (the whole projected q of width d_model and k of num_kv_heads*head_dim, before
  # the split into heads, each with its own full-width gain when norm_gain: SimpleGPT's QK-norm
  # baseline, OLMo-core's default).
  model.qk_norm_scope = "head"
  model.dt = 1.0  # residual step of every additive placement
  model.embed_norm = False  # norm right after the embedding (Peri-LN option)
  model.init_std = 0.02
  model.dtype = "float32"  # compute dtype; params stay float32
  model.remat = False  # rematerialise each block in the backward pass
  # auto (blocked on a CPU, cudnn on a GPU in bf16/fp16, dense elsewhere) | dense (full L x L
  # scores, masked) | blocked (blocks of queries that skip the masked keys) | cudnn (fused
  # kernel, NVIDIA GPUs only).
  # Every choice computes the same function; they differ in speed (results/bench/train.json).
  model.attention = "auto"
  # One block's parameters stacked along a leading `layers` axis and the blocks run as a
  # lax.scan: compile time no longer grows with depth (MaxText's scan_layers). Changes the
  # checkpoint layout (convert.stack_layers / unstack_layers move between the two).
  model.scan_layers = False
  # The LM head + cross-entropy of the training and evaluation loss in this many slices of
  # the sequence, each remade in the backward pass, so the B x L x V float32 logits never
  # exist at once (MaxText's vocabulary tiling): less memory for one more head matmul.
  # Must divide data.seq_len; 1 = all at once.
  model.loss_chunks = 1
  # PaLM's z-loss: the training objective adds z_loss * mean over tokens of log(Z)^2 (Z the
  # softmax's partition function), which keeps the output logits from drifting (Wortsman et
  # al. 2023; PaLM used 1e-4). 0 = off. Train metrics log `cross_entropy` and `z_loss` apart;
  # the validation loss stays the plain cross-entropy.
  model.z_loss = 0.0
  # Each placement's own fields (geo_*, mixln_fraction, ngpt_alpha_init, dyt_alpha_*, ...)
  # are declared by its registry entry in placements.py and added here.
  for name, option in placements.all_options().items():
    model[name] = option.default

  data = config.data = ml_collections.ConfigDict()
  data.source = "builtin"  # builtin | text | nanogpt_bin | fineweb_bin | array_record
  data.path = ""  # file (or glob of shards) for every source but builtin
  data.val_path = ""  # optional separate validation file; empty -> split from data.path
  data.tokenizer = "byte"  # byte | gpt2 (tiktoken, text sources only)
  data.seq_len = 128
  data.batch_size = 16  # global batch, in sequences
  data.sampling = "random"  # random windows | packed (consecutive, non-overlapping)
  data.val_fraction = 0.1  # tail of the corpus held out for validation
  data.seed = 0
  data.num_workers = 0  # grain worker processes; 0 = in-process

  train = config.train = ml_collections.ConfigDict()
  train.steps = 200
  train.grad_accum = 1  # micro-batches per step, accumulated inside the jitted step
  train.lr = 1e-3
  train.schedule = "cosine"  # cosine | wsd | linear | constant
  train.warmup_steps = 20
  train.decay_fraction = 0.2  # wsd: fraction of steps in the final decay
  train.min_lr_ratio = 0.1
  train.b1 = 0.9
  train.b2 = 0.95
  train.eps = 1e-8
  train.weight_decay = 0.1
  train.decay_embeddings = False
  train.weight_decay_scope = "matrices"  # matrices (see optim._decays) | all parameters
  train.clip_norm = 1.0
  train.lr_multipliers = ""  # "regex=mult,regex=mult" per-parameter-group LR multipliers
  train.eval_every = 100
  train.eval_batches = 8
  train.log_every = 10
  # Per-layer statistics and collapse diagnostics (geonorm_jax/training/collapse.py) every N steps
  # (one forward pass on one micro-batch); 0 = off, which also turns off the collapse warning.
  train.layer_stats_every = 25
  train.hessian_every = 0  # top Hessian eigenvalue every N steps; 0 = off
  train.hessian_steps = 20
  train.hessian_per_block = False
  train.peak_flops = 1e11  # per device, for MFU on CPU; accelerators use a table
  train.progress_bar = True
  train.sample_tokens = 200
  # A step whose loss or gradient norm is not finite: stop (exit non-zero, nothing saved after
  # the last finite checkpoint) | skip (the update is dropped inside the jitted step, counted).
  train.on_divergence = "stop"
  # End a run early once its train loss has stayed above its first logged value (the loss at
  # initialisation) for this many consecutive steps, or is not finite; 0 = never. For LR
  # sweeps far past the optimum (experiments/lr_sensitivity.py), where such a run counts at
  # the capped loss anyway: it evaluates, writes its summary (gave_up_step) and ends.
  train.give_up_steps = 0
  # A spike: the loss or the gradient norm more than spike_zscore standard deviations above its
  # mean over the previous 128 finite steps (training/spikes.py: OLMo-core's and llm.c's rule,
  # OLMo-core's threshold), judged once spike_warmup steps are known; 0 = off. Each is logged
  # under `spikes` in metrics.jsonl; with skip_spikes its update is dropped inside the step.
  train.spike_zscore = 6.0
  train.spike_warmup = 64
  train.skip_spikes = False
  # Weights & Biases (training/tracking.py; `pip install -e ".[wandb]"`): off | online |
  # offline (files in WORKDIR/wandb/, no network; `wandb sync` uploads them later).
  train.wandb = "off"
  train.wandb_project = "geonorm_jax"
  train.wandb_entity = ""  # "" = the W&B account's default entity
  train.wandb_group = ""  # "" = no group
  train.wandb_name = ""  # display name; "" = the workdir's folder name
  train.wandb_id = ""  # "" = from the workdir (tracking.run_id): a resume continues the run

  ckpt = config.checkpoint = ml_collections.ConfigDict()
  ckpt.every = 100
  ckpt.keep_last = 3
  ckpt.keep_every = 0  # also keep every K-th step forever; 0 = off
  ckpt.async_save = True

  mesh = config.mesh = ml_collections.ConfigDict()
  mesh.data = -1  # -1 fills from the device count
  mesh.fsdp = 1
  mesh.tensor = 1
  mesh.rules = ""  # overrides, "logical=physical,logical=physical" (physical may be "none")
  mesh.distributed = "auto"  # auto (initialize when env asks) | true | false
  mesh.coordinator_address = ""
  mesh.num_processes = 0
  mesh.process_id = -1
  return config


# name -> overrides of the base config. Paper sizes use their own vocabularies and contexts.
_GPT2_ARCH = dict(backbone="gpt2", vocab_size=50257, max_seq_len=1024)
_LLAMA2_ARCH = dict(backbone="llama", vocab_size=32000, max_seq_len=4096)
SIZES = {
    # Trains on a 2-core CPU in minutes; byte-level vocabulary.
    # Untied head: with a tied 256-byte embedding, Post-LN, DeepNorm, Mix-LN and GeoNorm collapse
    # to the unigram loss at this size (results/tie_embeddings/), which is not what their papers test.
    "tiny": dict(model=dict(num_layers=4, d_model=128, num_heads=4, max_seq_len=256,
                            tie_embeddings="false"),
                 data=dict(seq_len=128, batch_size=16)),
    # "tiny" on the LLaMA backbone (RMSNorm with gain and no bias, SwiGLU, no linear biases,
    # RoPE, untied head), with d_ff chosen so the parameter count matches: 894,080 parameters
    # against tiny's 891,648 (LLaMA's own rounding, 8/3 d -> 352, would give 869,504).
    "tiny_llama": dict(model=dict(backbone="llama", num_layers=4, d_model=128, num_heads=4,
                                  max_seq_len=256, d_ff=368),
                       data=dict(seq_len=128, batch_size=16)),
    "gpt2_124m": dict(model=dict(num_layers=12, d_model=768, num_heads=12, **_GPT2_ARCH)),
    "gpt2_350m": dict(model=dict(num_layers=24, d_model=1024, num_heads=16, **_GPT2_ARCH)),
    "gpt2_774m": dict(model=dict(num_layers=36, d_model=1280, num_heads=20, **_GPT2_ARCH)),
    "gpt2_1.5b": dict(model=dict(num_layers=48, d_model=1600, num_heads=25, **_GPT2_ARCH)),
    # GeoNorm's sizes: the authors' GPT-NeoX-style models (RoPE, untied head), NeoX vocab padded.
    "geonorm_125m": dict(model=dict(backbone="llama", num_layers=12, d_model=768, num_heads=12,
                                    vocab_size=50304, max_seq_len=2048, placement="geonorm")),
    "geonorm_1.3b": dict(model=dict(backbone="llama", num_layers=24, d_model=2048, num_heads=16,
                                    vocab_size=50304, max_seq_len=2048, placement="geonorm")),
    "llama2_1b": dict(model=dict(num_layers=18, d_model=2048, num_heads=16, d_ff=5632,
                                 **_LLAMA2_ARCH)),
    "llama2_7b": dict(model=dict(num_layers=32, d_model=4096, num_heads=32, d_ff=11008,
                                 **_LLAMA2_ARCH)),
    "llama3_8b": dict(model=dict(backbone="llama", num_layers=32, d_model=4096, num_heads=32,
                                 num_kv_heads=8, d_ff=14336, vocab_size=128256, max_seq_len=8192,
                                 rope_theta=500000.0)),
}
_SECTIONS = ("model", "data", "train", "checkpoint", "mesh")


def _apply(config, section, overrides):
  for key, value in overrides.items():
    getattr(config, section)[key] = value


def _parse_value(text, current):
  if isinstance(current, bool):
    if text.lower() not in ("true", "false", "1", "0"):
      raise ValueError(f"expected a boolean, got {text!r}")
    return text.lower() in ("true", "1")
  if isinstance(current, int):
    return int(text)
  if isinstance(current, float):
    return float(text)
  return text


def _resolve_key(config, key):
  """`placement` -> ('model', 'placement'); `train.lr` -> ('train', 'lr')."""
  if "." in key:
    section, name = key.split(".", 1)
    if section in _SECTIONS and name in getattr(config, section):
      return section, name
  else:
    found = [s for s in _SECTIONS if key in getattr(config, s)]
    if len(found) == 1:
      return found[0], key
    if len(found) > 1:
      raise ValueError(f"config key {key!r} is ambiguous; write one of "
                       f"{', '.join(s + '.' + key for s in found)}")
  raise ValueError(f"config key {key!r} is unknown")


def get_config(arg=None):
  """The base config with a preset applied: "tiny", or "size=gpt2_124m,placement=geonorm,lr=3e-4".

  A bare word is a size; other items are key=value with a section-qualified or unique key.
  """
  config = get_base_config()
  for item in filter(None, (arg or "tiny").split(",")):
    key, sep, value = item.partition("=")
    if not sep or key == "size":
      size = value if sep else key
      if size not in SIZES:
        raise ValueError(f"size {size!r} is unknown; valid: {', '.join(SIZES)}")
      for section, overrides in SIZES[size].items():
        _apply(config, section, overrides)
      continue
    section, name = _resolve_key(config, key)
    try:
      getattr(config, section)[name] = _parse_value(value, getattr(config, section)[name])
    except ValueError as e:
      raise ValueError(f"config {section}.{name}={value!r}: {e}") from None
  return config


# Keys that older versions saved: each maps to the keys that now carry its meaning (none: a
# rule that is gone, whose value no longer means anything).
RETIRED_KEYS = {
    "model.dyt_alpha_init": ("model.dyt_alpha_attn", "model.dyt_alpha_ffn", "model.dyt_alpha_final"),
    # The median-ratio loss-spike rule, replaced by train.spike_zscore's z-score.
    "train.spike_factor": (),
}


def from_dict(saved):
  """A saved run's config (config.json) laid over the base, so keys added since get defaults."""
  config = get_base_config()
  for section, values in saved.items():
    if section not in config:
      raise ValueError(f"saved config has an unknown section {section!r}")
    if isinstance(values, dict):
      for key, value in values.items():
        for new_key in RETIRED_KEYS.get(f"{section}.{key}", ()):
          new_section, new_name = new_key.split(".")
          config[new_section][new_name] = value
        if f"{section}.{key}" in RETIRED_KEYS:
          continue
        if key not in config[section]:
          raise ValueError(f"saved config has an unknown key {section}.{key}")
        config[section][key] = value
    else:
      config[section] = values
  return config
