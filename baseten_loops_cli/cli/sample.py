"""`loops sample`: generate text from a run's latest weights or from a sampler checkpoint.

Parse, call :mod:`baseten_loops_cli.services.sampling` (which sampler serves it, tokenizing,
decoding), render. The text goes to stdout; -o json is the ``SampleResponse``.
"""

import sys
from typing import Annotated, Optional

import typer

from baseten_loops_cli.cli import _complete
from baseten_loops_cli.cli._state import get_state


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
    stream: Annotated[bool, typer.Option("--stream", help="Print the text as it is generated (one sample, text output).")] = False,
) -> None:
    """Generate from a run's latest weights or from a sampler checkpoint.

    The text is printed on stdout (samples separated by a header line when -n > 1); -o json
    adds the prompt's tokens and each sample's tokens and logprobs; -o jsonl prints one sample
    per line.

    Examples:

      loops sample abc1234 --prompt "The capital of France is"

      loops sample abc1234:final --chat --prompt "Write a haiku about LoRA." -n 3 --temperature 0.8

      echo "2 + 2 =" | loops sample bt://loops:abc1234/sampler_weights/step-100 --prompt - -o json

      loops sample abc1234 --chat --prompt "Tell me a story." --max-tokens 256 --stream
    """
    from baseten_loops_cli.errors import UsageError
    from baseten_loops_cli.services.sampling import SampleRequest, resolve_source, sample_text, stream_text

    if system and not chat:
        raise UsageError("--system needs --chat", hint="A system message is part of a chat template.")
    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise UsageError("the prompt is empty", hint="Pass --prompt TEXT (or --prompt - to read it from stdin).")
    state = get_state(ctx)
    out = state.output
    if stream and n != 1:
        raise UsageError("--stream prints one sample", hint="Drop -n, or drop --stream to get several samples.")
    if stream:
        out.check_text_stream("--stream", hint="Drop --stream to get the whole answer as a document.")
    request = SampleRequest(prompt=prompt, chat=chat, system=system, n=n, max_tokens=max_tokens,
                            temperature=temperature, top_p=top_p, seed=seed)
    backend = state.backend()
    source = resolve_source(backend.client, target_ref, target)
    if source.started_sampler:
        _complete.invalidate("samplers")
        sid = source.sampler.id
        out.info(f"Started sampler {sid} for {source.uri} (its run is inactive). It scales to zero when idle; "
                 f"stop it with `loops samplers deactivate {sid}`.")
    if stream:
        text = ""
        for piece in stream_text(source, request, api_key=backend.api_key):
            out.text_piece(piece)
            text += piece
        out.text_piece("" if text.endswith("\n") else "\n")
        out.hint(f"Sampled {source.label} ({source.base_model}) with sampler {source.sampler.id}.")
        return
    answer = sample_text(source, request, api_key=backend.api_key)
    out.emit(answer, rows=answer.samples, id_key=lambda s: s.text.rstrip("\n"), text=_sample_lines(answer),
             hint=f"Sampled {source.label} ({answer.base_model}"
                  + (f", policy version {answer.policy_version}" if answer.policy_version is not None else "")
                  + f") with sampler {answer.sampler_id}.")


def _sample_lines(answer) -> list[str]:
    """The completions themselves (a header line before each when there are several)."""
    lines: list[str] = []
    for s in answer.samples:
        if len(answer.samples) > 1:
            lines.append(f"--- sample {s.index + 1} ({s.stop_reason}, {len(s.tokens)} tokens)")
        lines.append(s.text.rstrip("\n"))
    return lines
