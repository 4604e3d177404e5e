"""Conversions between gemma_spec_msgs and the engine's types. Imports no torch."""

from gemma_spec_msgs.action import Generate

from gemma_spec_ros.engine.types import GenerationRequest, GenerationResult, StreamDelta


def stats_to_msg(stats, msg):
    """Copy engine GenerationStats fields into a gemma_spec_msgs/GenerationStats message (same field names)."""
    for name, kind in msg.get_fields_and_field_types().items():
        value = getattr(stats, name, None)
        if value is None:
            continue
        if kind.startswith('sequence<float'):
            value = [float(v) for v in value]
        elif kind.startswith('float'):
            value = float(value)
        elif kind.startswith('uint') or kind.startswith('int'):
            value = max(0, int(value))
        setattr(msg, name, value)
    return msg


def goal_to_request(goal) -> GenerationRequest:
    """Build a GenerationRequest from the goal's fields as they are (0, '' and -1 mean what the action says)."""
    messages = [{'role': m.role, 'content': m.content} for m in goal.messages]
    return GenerationRequest(
        prompt='' if messages else goal.prompt, messages=messages or None, max_new_tokens=int(goal.max_new_tokens),
        temperature=float(goal.temperature), top_p=float(goal.top_p), top_k=int(goal.top_k), stop=list(goal.stop),
        seed=int(goal.seed), drafter=goal.drafter, num_draft_tokens=int(goal.num_draft_tokens),
        json_schema=goal.json_schema, grammar=goal.grammar, json_free_whitespace=bool(goal.json_free_whitespace))


def delta_to_feedback(delta: StreamDelta) -> Generate.Feedback:
    return Generate.Feedback(text_delta=delta.text, token_ids_delta=[int(t) for t in delta.token_ids],
                             tokens_generated=int(delta.tokens_generated), tau=float(delta.tau))


def result_to_msg(result: GenerationResult | None, error: str = '', finish_reason: str = '') -> Generate.Result:
    """Build the action result; error and finish_reason, when given, override the engine's."""
    msg = Generate.Result()
    if result is not None:
        msg.text, msg.token_ids = result.text, [int(t) for t in result.token_ids]
        msg.finish_reason = result.finish_reason
        stats_to_msg(result.stats, msg.stats)
        msg.warnings = list(result.warnings)
        msg.structure_complete = bool(result.structure_complete)
    msg.error = error
    msg.finish_reason = finish_reason or msg.finish_reason
    return msg
