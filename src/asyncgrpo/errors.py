"""Exception types a user can cause. Each message says what is wrong, the value, and the fix.

Everything here derives from `AsyncGRPOError`, which the CLI prints as one line with exit status 2; any other
exception is a bug in asyncgrpo.
"""


class AsyncGRPOError(Exception):
    """Base class for errors caused by input or environment, not by a bug in asyncgrpo."""


class PeerFailed(AsyncGRPOError):
    """Raised on every rank but 0 when rank 0 failed at a point all ranks meet (`distributed.on_main`): rank 0
    raises and prints the original error; the others stop at once, quietly, with the same exit code."""


class ConfigError(AsyncGRPOError):
    """A config key is unknown, has the wrong type, or conflicts with another key."""

    def __init__(self, field: str, problem: str, fix: str):
        self.field = field
        super().__init__(f"config `{field}`: {problem}. Fix: {fix}")


class ConfigErrors(ConfigError):
    """Several config values are wrong at once: one line each (key, value, fix), so that a file is corrected in one
    go. `field` is the first key, `errors` every ConfigError."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = errors
        self.field = errors[0].field
        lines = "\n".join(f"  {error}" for error in errors)
        AsyncGRPOError.__init__(self, f"{len(errors)} config values are wrong:\n{lines}")


class InferenceServerError(AsyncGRPOError):
    """The inference server is unreachable or answered with an error.

    `status` is the HTTP status (None when no answer came) and `body` the server's text, quoted verbatim:
    vLLM answers adapter calls in plain text, not JSON.
    """

    def __init__(self, message: str, status: int | None = None, body: str | None = None):
        self.status = status
        self.body = body
        super().__init__(message)


class ServerUnreachableError(InferenceServerError):
    """No HTTP answer came: the connection was refused or broke (the server is down or restarting).

    The rollout producer and the publisher wait for such a server to come back (`vllm_server_timeout`)."""


class AdapterNotLoadedError(InferenceServerError):
    """A server answered that the adapter a request named does not exist (vLLM: HTTP 404 "The model `X` does not
    exist"). A restarted vLLM knows no adapters until they are registered again, so the rollout producer treats this
    like a restart (the group is lost and the server recovered), unless it comes again right after a recovery."""


class BehaviourLogprobError(InferenceServerError):
    """A server reported a sampled token's logprob that no sampler can produce (NaN, infinite, or below
    `rollout.producer.BEHAVIOUR_LOGPROB_FLOOR`): training on it would make the loss NaN or meaningless."""


class RewardFunctionError(AsyncGRPOError):
    """A reward function raised or returned something that is not one float per completion."""


class SyncError(AsyncGRPOError):
    """Publishing a new adapter version to the inference server failed; the previous version keeps serving."""


class ServedPolicyError(SyncError):
    """A server's logprobs under a version's adapter name differ from the trainer's beyond the run's bound
    (`served_check_every`): it does not serve what was trained, and training on its samples would be off-policy."""


class CheckpointError(AsyncGRPOError):
    """A checkpoint cannot be saved or resumed from (missing, incomplete, corrupt, or an unsupported backend)."""


class RolloutProcessError(AsyncGRPOError):
    """The rollout process (`rollout_process: true`, or `asyncgrpo rollout-serve` at `rollout_address`) could not be
    reached, died, stopped answering, or raised an error that could not be rebuilt in the trainer with its own type
    (the message then carries that type, its message and its traceback)."""


class ToolError(AsyncGRPOError):
    """A user's tool or environment broke the episode itself (not an error the model can read and recover from):
    a tool that ended its worker thread (SystemExit and the like), an environment that cannot be built or reset."""


class AgentFunctionError(AsyncGRPOError):
    """`agent_function` broke an episode: it raised, returned something that is not a reward, or made no call to the
    agent endpoint."""
