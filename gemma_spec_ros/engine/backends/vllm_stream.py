"""
The HTTP side of a vLLM server: a GET, and a streamed POST read as server-sent events into ``Collected``.

Stdlib only (http.client, JSON). One connection per call; cancelling shuts the streaming socket down, so that a
blocked read returns at once, and vLLM aborts the request when the connection closes. A fault of the server
(unreachable, gone mid-stream, silent past request_timeout, HTTP 5xx) raises ServerUnavailable naming the URL; a
request it refuses (HTTP 400) raises ValueError.
"""

import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ..types import CancelToken, DeltaCallback, StreamDelta
from .vllm_metrics import UNKNOWN_FLOAT, UNKNOWN_INT
from .vllm_reply import CallReader

# vLLM's finish reasons that are ours too (tool_calls: the reply made calls; VllmBackend decides whether they count)
_FINISH_REASONS = {'stop': 'stop', 'length': 'length', 'tool_calls': 'tool_calls'}


class ServerUnavailable(ConnectionError):
    """The server could not be reached or broke the connection; the message names the URL."""


@dataclass
class Collected:
    """What a stream delivered so far."""

    pieces: list[str] = field(default_factory=list)
    thoughts: list[str] = field(default_factory=list)   # delta.reasoning (a server with a reasoning parser)
    calls: CallReader = field(default_factory=lambda: CallReader(()))   # delta.tool_calls (a tool-call parser)
    token_ids: list[int] = field(default_factory=list)
    arrivals: list[tuple[float, int]] = field(default_factory=list)   # (time, tokens) per chunk with tokens
    prompt_tokens: int = UNKNOWN_INT
    cached_prompt_tokens: int = 0    # usage.prompt_tokens_details.cached_tokens: the server's prefix-cache hit
    completion_tokens: int = UNKNOWN_INT
    finish_reason: str = ''
    server_reason: str = ''          # vLLM's finish_reason when it is not one of ours
    stop_string: str = ''            # the stop string that ended the text ('' when EOS or the length did)
    request_id: str = ''

class _CancelWatch:
    """Shuts a connection's socket down when the cancel token fires, so that a blocked read returns at once."""

    POLL_SECONDS = 0.02

    def __init__(self, cancel: CancelToken | None, connection: http.client.HTTPConnection):
        self._cancel, self._connection = cancel, connection
        self._done = threading.Event()
        self._thread = None
        if cancel is not None:
            self._thread = threading.Thread(target=self._run, name='vllm-cancel-watch', daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.POLL_SECONDS):
            if self._cancel.cancelled:
                self.shut()
                return

    def shut(self) -> None:
        # shutdown, not close: the response still holds the socket, and only a shutdown ends the server's request
        sock = self._connection.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        if self._cancel is not None and self._cancel.cancelled:   # the reader saw it first
            self.shut()

class ServerClient:
    """Calls to one vLLM server; thread-safe (each call opens its own connection)."""

    def __init__(self, url: str, connect_timeout: float, request_timeout: float):
        """url: the server's base URL (checked by VllmBackend); timeouts in seconds (vllm.connect_timeout, ...)."""
        self.url = url.rstrip('/')
        self._parts = urlsplit(url)
        self.connect_timeout = connect_timeout
        self.request_timeout = request_timeout

    def get(self, path: str) -> bytes:
        connection = self._connection(self.connect_timeout)
        try:
            connection.request('GET', path)
            response = connection.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise ServerUnavailable('vLLM server at {} is unreachable: {}'.format(self.url, exc)) from exc
        finally:
            connection.close()
        if response.status != 200:
            raise ServerUnavailable('vLLM server at {} answered {} {} on {}'.format(
                self.url, response.status, response.reason, path))
        return payload

    def post(self, path: str, body: dict) -> bytes:
        """POST JSON and return the answer; ServerUnavailable if unreachable, ValueError if refused (HTTP 400)."""
        connection = self._connection(self.connect_timeout)
        try:
            connection.request('POST', path, json.dumps(body), {'Content-Type': 'application/json'})
            response = connection.getresponse()
            if response.status != 200:
                self._refuse(path, response)
            return response.read()
        except (OSError, http.client.HTTPException) as exc:
            raise ServerUnavailable('vLLM server at {} is unreachable: {}'.format(self.url, exc)) from exc
        finally:
            connection.close()

    def tokenize(self, model: str, text: str) -> list[int]:
        """Return the ids of text as the server's tokenizer reads it (special tokens parsed, no BOS)."""
        answer = self.post('/tokenize', {'model': model, 'prompt': text, 'add_special_tokens': False})
        try:
            return [int(token) for token in json.loads(answer)['tokens']]
        except (ValueError, KeyError, TypeError) as exc:
            raise ServerUnavailable('vLLM server at {} sent unreadable /tokenize: {}'.format(self.url, exc)) from exc

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self._parts.scheme == 'https' else http.client.HTTPConnection
        return kind(self._parts.hostname, self._parts.port, timeout=timeout)

    def stream(self, path: str, body: dict, collected: Collected, on_delta: DeltaCallback | None,
                cancel: CancelToken | None) -> None:
        connection = self._connection(self.connect_timeout)
        watch = None
        try:
            try:
                connection.connect()
            except OSError as exc:
                raise ServerUnavailable('vLLM server at {} is unreachable: {}'.format(self.url, exc)) from exc
            connection.sock.settimeout(self.request_timeout)
            watch = _CancelWatch(cancel, connection)
            try:
                connection.request('POST', path, json.dumps(body), {'Content-Type': 'application/json',
                                                                    'Accept': 'text/event-stream'})
                response = connection.getresponse()
            except OSError as exc:
                raise ServerUnavailable('vLLM server at {} did not answer {}: {}'.format(self.url, path, exc)) \
                    from exc
            if response.status != 200:
                self._refuse(path, response)
            self._read_events(response, collected, on_delta, cancel)
        finally:
            if watch is not None:
                watch.stop()
            connection.close()

    def _refuse(self, path: str, response: http.client.HTTPResponse) -> None:
        try:
            payload = json.loads(response.read() or b'{}')
            message = payload.get('error', {}).get('message') if isinstance(payload.get('error'), dict) \
                else payload.get('message') or payload.get('detail') or payload
        except (OSError, ValueError, AttributeError):
            message = response.reason
        if response.status == 400:
            raise ValueError('vLLM server refused the request: {}'.format(message))
        raise ServerUnavailable('vLLM server at {} answered {} {} on {}: {}'.format(
            self.url, response.status, response.reason, path, message))

    def _read_events(self, response: http.client.HTTPResponse, collected: Collected,
                     on_delta: DeltaCallback | None, cancel: CancelToken | None = None) -> None:
        while True:
            if cancel is not None and cancel.cancelled:
                # stop at once: chunks the server sent before the watch closed the connection may sit in the
                # buffer (a starved client would otherwise read a whole finished reply after the cancel)
                return
            try:
                line = response.readline()
            except TimeoutError as exc:
                raise ServerUnavailable('vLLM server at {} sent nothing for {:g} s (vllm.request_timeout) after {} '
                                        'tokens'.format(self.url, self.request_timeout,
                                                        len(collected.token_ids))) from exc
            except (OSError, http.client.HTTPException) as exc:
                raise ServerUnavailable('vLLM server at {} broke the stream after {} tokens: {}'.format(
                    self.url, len(collected.token_ids), exc or type(exc).__name__)) from exc
            if not line:
                raise ServerUnavailable('vLLM server at {} closed the stream after {} tokens'.format(
                    self.url, len(collected.token_ids)))
            line = line.strip()
            if not line.startswith(b'data:'):
                continue
            data = line[len(b'data:'):].strip()
            if data == b'[DONE]':
                return
            self._take_chunk(json.loads(data), collected, on_delta)

    def _take_chunk(self, chunk: dict, collected: Collected, on_delta: DeltaCallback | None) -> None:
        arrived = time.perf_counter()
        if 'error' in chunk:  # vLLM reports errors found after the 200 header as a chunk
            error = chunk['error'] if isinstance(chunk['error'], dict) else {'message': chunk['error']}
            if error.get('code') == 400 and not collected.token_ids:
                raise ValueError('vLLM server refused the request: {}'.format(error.get('message')))
            raise ServerUnavailable('vLLM server at {} failed the request: {}'.format(self.url, error.get('message')))
        collected.request_id = collected.request_id or chunk.get('id', '')
        usage = chunk.get('usage') or {}
        if 'completion_tokens' in usage:
            collected.prompt_tokens = int(usage.get('prompt_tokens', UNKNOWN_INT))
            collected.cached_prompt_tokens = int((usage.get('prompt_tokens_details') or {}).get('cached_tokens') or 0)
            collected.completion_tokens = int(usage['completion_tokens'])
        for choice in chunk.get('choices') or []:
            delta = choice.get('delta') or {}
            text = choice.get('text')
            if text is None:
                text = delta.get('content') or ''
            # vLLM 0.32 names it reasoning; older servers reasoning_content
            thought = delta.get('reasoning') or delta.get('reasoning_content') or ''
            token_ids = [int(token) for token in choice.get('token_ids') or []]
            reason = choice.get('finish_reason')
            if reason:
                collected.finish_reason = _FINISH_REASONS.get(reason, '')
                collected.server_reason = reason
                stop_reason = choice.get('stop_reason')  # the matched stop string, a stop token id, or None (EOS)
                collected.stop_string = stop_reason if isinstance(stop_reason, str) else ''
            # a call is complete once the next one begins, or when the reply ends (not when it was cut off)
            calls = collected.calls.add(delta.get('tool_calls') or [], reason in ('stop', 'tool_calls'))
            if not text and not token_ids and not thought and not calls:
                continue
            collected.pieces.append(text)
            collected.thoughts.append(thought)
            collected.token_ids += token_ids
            collected.arrivals.append((arrived, len(token_ids)))
            if on_delta is not None:
                on_delta(StreamDelta(text, token_ids, len(collected.token_ids), UNKNOWN_FLOAT, thought, calls))
