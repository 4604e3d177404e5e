"""
The planner category: held-out robot-task conversations run as a planner runs them, through our engine with tools.

``python -m gemma_spec_ros bench --planner [N]`` takes N held-out conversations of train/corpora/planner.py (object and
place combinations or phrasings never trained on) and runs each as a planner loop: the request with the robot's
tools (config/robot_tools.json, tool_choice auto, the conversation's thinking), each returned call answered with
{"ok": true}, until the model answers (at most MAX_REPLIES replies). Greedy; every drafter, interleaved in a
shuffled order per conversation and repeat. Reported:

- exact sequences: conversations whose whole call sequence (names and arguments) is the expected one;
- valid calls: calls whose arguments validate against the tool's schema (the grammar makes every call valid);
- per drafter: tau (tokens per target pass over the loop), decode tokens/s (wall clock after each reply's first
  token, medians over repeats of sums over conversations) and the speedup over plain decoding; whether every
  drafter's tokens equal plain decoding's.
"""

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from gemma_spec_ros.benchmarks.harness import Settings, load_engine
from gemma_spec_ros.benchmarks.report import machine_description, write_json
from gemma_spec_ros.engine.types import GenerationRequest
from gemma_spec_ros.train.corpora import planner

MAX_REPLIES = 8
OK = json.dumps({'ok': True})


@dataclass
class Loop:
    """One planner loop of one conversation with one drafter."""

    calls: list[tuple[str, dict]] = field(default_factory=list)
    answer: str = ''
    tokens: list[int] = field(default_factory=list)
    new_tokens: int = 0
    passes: int = 0
    decode_s: float = 0.0
    replies: int = 0


def run_loop(engine, conversation: planner.Conversation, drafter: str, max_new_tokens: int) -> Loop:
    """Run conversation's request as a planner would: calls answered {"ok": true} until the model answers."""
    messages = [dict(message) for message in conversation.prompt_messages]
    tools, loop = json.dumps(conversation.tools), Loop()
    for _ in range(MAX_REPLIES):
        result = engine.generate(GenerationRequest(
            messages=messages, tools=tools, tool_choice='auto', thinking=conversation.thinking,
            max_new_tokens=max_new_tokens, drafter=drafter))
        stats = result.stats
        loop.replies += 1
        loop.tokens += result.token_ids
        loop.new_tokens += stats.new_tokens
        loop.passes += stats.target_passes
        loop.decode_s += max(stats.wall_time - stats.time_to_first_token, 0.0)
        if result.finish_reason != 'tool_calls':
            loop.answer = result.text.strip()
            break
        messages.append({'role': 'assistant', 'content': result.text, 'tool_calls': [
            {'id': call.id, 'name': call.name, 'arguments': call.arguments} for call in result.tool_calls]})
        for call in result.tool_calls:
            loop.calls.append((call.name, json.loads(call.arguments)))
            messages.append({'role': 'tool', 'name': call.name, 'content': OK})
    return loop


def run(settings: Settings, conversations: int, out: Path, command: str, progress) -> dict:
    """Measure; write results.json and results.md into out; return the document."""
    started = time.time()
    engine = load_engine(settings, progress, settings.compile_modes[0])
    systems = ['none'] + [name for name in settings.drafters if name != 'none']
    held_out = [planner.held_out_conversation(seed) for seed in range(conversations)]
    order = random.Random(settings.seed)
    loops: dict[str, list[list[Loop]]] = {name: [[] for _ in held_out] for name in systems}
    for repeat in range(settings.repeats):
        for index, conversation in enumerate(held_out):
            for name in order.sample(systems, len(systems)):
                loops[name][index].append(run_loop(engine, conversation, name, settings.max_new_tokens))
            plain = loops['none'][index][-1]
            progress('{}/{} repeat {}: {} {} -> {}'.format(
                index + 1, len(held_out), repeat + 1, 'ok ' if plain.calls == conversation.calls else 'bad',
                conversation.request, plain.calls))
    document = {
        'schema': 'gemma_spec_ros.bench.planner/1', 'command': command,
        'machine': machine_description(settings.threads),
        'date': datetime.now(UTC).isoformat(timespec='seconds'), 'settings': asdict(settings),
        'conversations': conversations, 'accuracy': accuracy(held_out, [runs[0] for runs in loops['none']]),
        'systems': summarize(systems, loops), 'seconds': round(time.time() - started, 1)}
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / 'results.json', document)
    (out / 'results.md').write_text(markdown(document))
    return document


def accuracy(held_out: list[planner.Conversation], loops: list[Loop]) -> dict:
    """Exact call sequences, valid calls and exact answers of plain decoding's loops."""
    exact = sum(loop.calls == conversation.calls for conversation, loop in zip(held_out, loops, strict=True))
    calls = [(name, arguments, conversation.tools) for conversation, loop in zip(held_out, loops, strict=True)
             for name, arguments in loop.calls]
    valid = sum(planner.valid_arguments(name, arguments, tools) for name, arguments, tools in calls)
    answers = sum(loop.answer == conversation.answer for conversation, loop in zip(held_out, loops, strict=True))
    wrong = [{'request': conversation.request, 'expected': conversation.calls, 'made': loop.calls}
             for conversation, loop in zip(held_out, loops, strict=True) if loop.calls != conversation.calls]
    return {'exact_sequences': exact / len(held_out), 'valid_calls': valid / max(len(calls), 1), 'calls': len(calls),
            'exact_answers': answers / len(held_out), 'wrong': wrong[:8]}


def summarize(systems: list[str], loops: dict[str, list[list[Loop]]]) -> dict:
    """Per system: tau, decode tokens/s (median over repeats of sums over conversations), speedup, token parity."""
    summary = {}
    for name in systems:
        repeats = len(loops[name][0])
        rates = [sum(runs[r].new_tokens for runs in loops[name]) / sum(runs[r].decode_s for runs in loops[name])
                 for r in range(repeats)]
        tokens = sum(runs[0].new_tokens for runs in loops[name])
        passes = sum(runs[0].passes for runs in loops[name])
        same = all(run.tokens == plain[0].tokens for runs, plain in zip(loops[name], loops['none'], strict=True)
                   for run in runs)
        summary[name] = {'tau': tokens / max(passes, 1), 'tokens_per_second': statistics.median(rates),
                         'identical_to_plain': same}
    plain = summary['none']['tokens_per_second']
    for entry in summary.values():
        entry['speedup'] = entry['tokens_per_second'] / plain
    return summary


def markdown(document: dict) -> str:
    accuracy_, settings = document['accuracy'], document['settings']
    lines = ['# Planner conversations ({} held-out, greedy, {} repeat(s), {} thread(s), compile {})'.format(
        document['conversations'], settings['repeats'], settings['threads'], settings['compile_modes'][0]), '',
             '`{}`'.format(document['command']), '',
             '| exact call sequences | valid calls | exact answers | calls |', '|---|---|---|---|',
             '| {:.0%} | {:.0%} | {:.0%} | {} |'.format(accuracy_['exact_sequences'], accuracy_['valid_calls'],
                                                     accuracy_['exact_answers'], accuracy_['calls']), '',
             '| drafter | tau | decode tok/s | speedup | tokens = plain |', '|---|---|---|---|---|']
    for name, entry in document['systems'].items():
        lines.append('| {} | {:.2f} | {:.1f} | {:.2f}x | {} |'.format(
            name, entry['tau'], entry['tokens_per_second'], entry['speedup'],
            'yes' if entry['identical_to_plain'] else 'NO'))
    return '\n'.join(lines) + '\n'
