"""`loops sample`: generate text from a run's latest weights or from a sampler checkpoint.

The prompt is tokenized here with the base model's tokenizer (``--chat`` renders it with the
model's chat template first) and sent to a sampler's ``/sample`` as token ids, exactly as
training code does; the answer is decoded back to text.

Which sampler serves it:

- a run: its paired sampler (created on first use, as the SDK does), serving the latest weights;
- a checkpoint of an active run: that run's sampler, pinned to the checkpoint
  (``X-Checkpoint-Path``);
- a checkpoint of a deactivated run: a standalone sampler serving it (reused when one exists,
  created otherwise and left running, like any sampler: it scales to zero when idle).
"""

import sys
from typing import Annotated, Any, Optional

import typer

from baseten_loops_cli.cli import _complete
from baseten_loops_cli.cli._state import get_state


def _looks_like_checkpoint(text: str) -> bool:
    return text.startswith(("bt://", "abt://")) or ":" in text


def _resolve_target(client, text: str, target: str | None) -> tuple[dict | None, dict | None]:
    """(run, checkpoint): a run id gives (run, None); a checkpoint gives (its run or None, cp)."""
    from baseten_loops_cli.api.errors import NotFoundError
    from baseten_loops_cli.cli._resolve import NotFound, as_dict, resolve_checkpoint, run_not_found

    if _looks_like_checkpoint(text) or target:
        return None, resolve_checkpoint(client, text, target, prefer="sampler")
    try:
        return as_dict(client.runs.get(text)), None
    except NotFoundError:
        pass
    try:  # a checkpoint id?
        return None, resolve_checkpoint(client, text)
    except NotFound:
        err = run_not_found(client, text)
        err.message = f"no run or checkpoint {text!r}"
        raise err from None


def _paired_sampler(client, run: dict) -> dict:
    """The run's live paired sampler, created if it has none (idempotent per run)."""
    from baseten_loops_cli.cli._resolve import SAMPLER_TERMINAL, as_dict, status_name

    sampler = run.get("sampler")
    if sampler and status_name(sampler) not in SAMPLER_TERMINAL:
        return sampler
    session_id = run.get("session_id") or client.sessions.create().id
    return as_dict(client.samplers.create({"session_id": session_id, "run_id": run["id"]}))


def _checkpoint_sampler(out, client, cp: dict, uri: str) -> tuple[dict, str | None, str | None]:
    """(sampler, run_id header, checkpoint pin) serving sampler checkpoint ``cp``."""
    from baseten_loops_cli.api.errors import ApiError
    from baseten_loops_cli.cli._resolve import SAMPLER_TERMINAL, as_dict, status_name

    try:
        run = as_dict(client.runs.get(cp["run_id"]))
    except ApiError:
        run = None
    if run and status_name(run) == "ACTIVE":
        return _paired_sampler(client, run), run["id"], uri
    for s in as_dict(client.samplers.list()) or []:
        if s.get("model_path") == uri and status_name(s) not in SAMPLER_TERMINAL:
            return s, None, None
    session_id = client.sessions.create().id
    sampler = as_dict(client.samplers.create({"session_id": session_id, "model_path": uri}))
    _complete.invalidate("samplers")
    out.info(
        f"Started sampler {sampler['id']} for {uri} (its run is inactive). It scales to zero when idle; "
        f"stop it with `loops samplers deactivate {sampler['id']}`."
    )
    return sampler, None, None


def sample(
    ctx: typer.Context,
    target_ref: Annotated[
        str,
        typer.Argument(
            metavar="RUN|CKPT",
            help="A run id (its latest weights) or a sampler checkpoint (id, bt:// URI or RUN:NAME).",
            autocompletion=_complete.complete_checkpoint,
            show_default=False,
        ),
    ],
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="The prompt text ('-' reads stdin).", show_default=False)],
    chat: Annotated[bool, typer.Option("--chat", help="Render the prompt as a user message with the model's chat template.")] = False,
    system: Annotated[Optional[str], typer.Option("--system", help="A system message (with --chat).")] = None,
    n: Annotated[int, typer.Option("-n", "--num-samples", min=1, max=64, help="How many samples.")] = 1,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="Tokens to generate at most, per sample.")] = 64,
    temperature: Annotated[float, typer.Option("--temperature", "-T", min=0.0, help="Sampling temperature (0 = greedy).")] = 1.0,
    top_p: Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Seed, for reproducible samples.")] = None,
    target: Annotated[Optional[str], typer.Option("--target", "-t", help="With RUN:NAME: sampler (default) or trainer.")] = None,
) -> None:
    """Generate from a run's latest weights or from a sampler checkpoint.

    The text is printed on stdout (samples separated by a header line when -n > 1); -o json
    adds the prompt's tokens and each sample's tokens and logprobs; -o jsonl prints one sample
    per line.

    Examples:

      loops sample abc1234 --prompt "The capital of France is"

      loops sample abc1234:final --chat --prompt "Write a haiku about LoRA." -n 3 --temperature 0.8

      echo "2 + 2 =" | loops sample bt://loops:abc1234/sampler_weights/step-100 --prompt - -o json
    """
    from baseten_loops_cli.cli._resolve import display_name, uri_of
    from baseten_loops_cli.errors import UsageError

    if system and not chat:
        raise UsageError("--system needs --chat", hint="A system message is part of a chat template.")
    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise UsageError("the prompt is empty", hint="Pass --prompt TEXT (or --prompt - to read it from stdin).")
    state = get_state(ctx)
    out = state.output
    backend = state.backend()
    client = backend.client
    run, cp = _resolve_target(client, target_ref, target)
    pin: str | None = None
    if cp is not None:
        if cp.get("target") != "sampler":
            raise UsageError(
                f"{target_ref} is a trainer checkpoint (training state); samplers serve sampler weights",
                hint=f"Sample a sampler checkpoint: loops checkpoints list --run-id {cp.get('run_id')} --target sampler",
            )
        uri = uri_of(cp) or ""
        sampler, run_header, pin = _checkpoint_sampler(out, client, cp, uri)
        base_model = str(cp.get("base_model") or sampler.get("base_model"))
        source = {"checkpoint": display_name(cp), "checkpoint_id": cp.get("id"), "uri": uri, "run_id": cp.get("run_id")}
    else:
        assert run is not None
        from baseten_loops_cli.cli._resolve import status_name
        from baseten_loops_cli.errors import LoopsError

        if status_name(run) != "ACTIVE":
            raise LoopsError(
                f"run {run['id']} is {status_name(run)}: it has no live weights to sample",
                hint=f"Sample one of its checkpoints: loops checkpoints list --run-id {run['id']} --target sampler",
            )
        sampler = _paired_sampler(client, run)
        run_header = run["id"]
        base_model = str(run.get("base_model"))
        source = {"checkpoint": None, "checkpoint_id": None, "uri": None, "run_id": run["id"]}

    from baseten_loops_cli.tokenization import get_tokenizer, render_chat
    from baseten_loops_cli.workers.sampler import SamplerClient

    tokenizer = get_tokenizer(base_model)
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        tokens, _ = render_chat(tokenizer, messages, add_generation_prompt=True)
        tokens = list(tokens)
    else:
        tokens = list(tokenizer.encode(prompt))
    stops = list(getattr(tokenizer, "stop_token_ids", ()) or ())
    if not stops and getattr(tokenizer, "eos_token_id", None) is not None:
        stops = [tokenizer.eos_token_id]
    with SamplerClient(
        sampler["base_url"],
        api_key=backend.api_key,
        run_id=run_header,
        sampler_id=None if run_header else sampler.get("id"),
    ) as sc:
        result = sc.sample(
            tokens,
            n=n,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop=stops or None,
            checkpoint_path=pin,
        )
    samples: list[dict[str, Any]] = []
    for i, seq in enumerate(result.sequences):
        ids = [t for t in seq.tokens if t not in stops]
        samples.append({
            "index": i,
            "text": tokenizer.decode(ids, skip_special_tokens=True),
            "tokens": list(seq.tokens),
            "logprobs": list(seq.logprobs) if seq.logprobs is not None else None,
            "stop_reason": seq.stop_reason,
        })
    doc = {
        **source,
        "base_model": base_model,
        "sampler_id": sampler.get("id"),
        "policy_version": result.policy_version,
        "chat": chat,
        "prompt": prompt,
        "prompt_tokens": tokens,
        "samples": samples,
    }
    if out.format in ("json", "yaml", "none") or (out.format == "jsonl" and not out.quiet):
        if out.format == "jsonl":
            for s in samples:
                out.emit_record(s)
        else:
            out.emit(doc, id_key="sampler_id")
        return
    # text for people (and -q): the completions themselves
    for s in samples:
        if len(samples) > 1 and not out.quiet:
            out.streams.stdout.write(f"--- sample {s['index'] + 1} ({s['stop_reason']}, {len(s['tokens'])} tokens)\n")
        out.streams.stdout.write(s["text"].rstrip("\n") + "\n")
    out.streams.stdout.flush()
    what = source["checkpoint"] or f"run {source['run_id']}"
    version = f", policy version {result.policy_version}" if result.policy_version is not None else ""
    out.hint(f"Sampled {what} ({base_model}{version}) with sampler {sampler.get('id')}.")
