# mypy: ignore-errors
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_STARTING: _ClassVar[Phase]
    PHASE_TRAINING: _ClassVar[Phase]
    PHASE_AVERAGING: _ClassVar[Phase]
    PHASE_WAITING: _ClassVar[Phase]
    PHASE_DRAINING: _ClassVar[Phase]
    PHASE_STOPPED: _ClassVar[Phase]
PHASE_UNSPECIFIED: Phase
PHASE_STARTING: Phase
PHASE_TRAINING: Phase
PHASE_AVERAGING: Phase
PHASE_WAITING: Phase
PHASE_DRAINING: Phase
PHASE_STOPPED: Phase

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("peer_id", "run_id", "round", "phase", "peers_visible", "last_averaging", "schedule", "val_loss", "inner_loss", "tokens_per_s", "uptime_s", "last_checkpoint_round", "last_checkpoint_path", "version", "problem")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PEERS_VISIBLE_FIELD_NUMBER: _ClassVar[int]
    LAST_AVERAGING_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    VAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    INNER_LOSS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_ROUND_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    run_id: str
    round: int
    phase: Phase
    peers_visible: int
    last_averaging: AveragingResult
    schedule: ScheduleInfo
    val_loss: float
    inner_loss: float
    tokens_per_s: float
    uptime_s: float
    last_checkpoint_round: int
    last_checkpoint_path: str
    version: str
    problem: str
    def __init__(self, peer_id: _Optional[str] = ..., run_id: _Optional[str] = ..., round: _Optional[int] = ..., phase: _Optional[_Union[Phase, str]] = ..., peers_visible: _Optional[int] = ..., last_averaging: _Optional[_Union[AveragingResult, _Mapping]] = ..., schedule: _Optional[_Union[ScheduleInfo, _Mapping]] = ..., val_loss: _Optional[float] = ..., inner_loss: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., uptime_s: _Optional[float] = ..., last_checkpoint_round: _Optional[int] = ..., last_checkpoint_path: _Optional[str] = ..., version: _Optional[str] = ..., problem: _Optional[str] = ...) -> None: ...

class AveragingResult(_message.Message):
    __slots__ = ("round", "ok", "group_size", "staleness", "bytes_sent", "bytes_received", "codec", "seconds", "error")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    round: int
    ok: bool
    group_size: int
    staleness: int
    bytes_sent: int
    bytes_received: int
    codec: str
    seconds: float
    error: str
    def __init__(self, round: _Optional[int] = ..., ok: _Optional[bool] = ..., group_size: _Optional[int] = ..., staleness: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., codec: _Optional[str] = ..., seconds: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class ScheduleInfo(_message.Message):
    __slots__ = ("batch_sizes", "inner_steps", "accumulation", "instances", "codec")
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    ACCUMULATION_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    inner_steps: int
    accumulation: _containers.RepeatedScalarFieldContainer[int]
    instances: int
    codec: str
    def __init__(self, batch_sizes: _Optional[_Iterable[int]] = ..., inner_steps: _Optional[int] = ..., accumulation: _Optional[_Iterable[int]] = ..., instances: _Optional[int] = ..., codec: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("accepted", "message")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    message: str
    def __init__(self, accepted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointReply(_message.Message):
    __slots__ = ("round", "path")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    round: int
    path: str
    def __init__(self, round: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...
