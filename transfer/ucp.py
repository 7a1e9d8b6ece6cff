"""The few UCP C calls that ucxx 0.52's Python API lacks, through ctypes on ucxx's own libucp:
the library, its requests and errors, and the tagged-message operations with an iov datatype
(the KV push gathers from and scatters into pool blocks with one UCX operation each; ucxx has no
iov datatype). The listener bound to one address is transfer/ucp_listener.py.

The UCP API is a stable C ABI (structs start with a `field_mask`, later versions only append
fields): the layouts below (UCX 1.21, pinned through ucxx 0.52.*) stay valid, with spare room.
Not thread safe: use it on the progressing thread.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import libucx
import numpy as np

from transfer.env import configure_ucx_env

configure_ucx_env()  # before UCX is loaded: it reads part of its environment on load
# The libraries ucxx itself loads (same resolution, so the same handles and globals).
ucs, _ucs_signal, _uct, lib = libucx.load_library()

VOID_P = ctypes.c_void_p
STATUS = ctypes.c_int8  # ucs_status_t

UCS_OK = 0
UCS_INPROGRESS = 1
_UCS_ERR_LAST = -100
_PTR_ERR_MIN = (1 << 64) + _UCS_ERR_LAST  # status pointers at or above this are errors
OP_FIELD_FLAGS = 1 << 4


class SockAddr(ctypes.Structure):  # ucs_sock_addr_t
    _fields_ = [("addr", VOID_P), ("addrlen", ctypes.c_uint32)]


class Handler(ctypes.Structure):  # ucp_listener_conn_handler_t / ucp_err_handler_t
    _fields_ = [("cb", VOID_P), ("arg", VOID_P)]


class RequestParam(ctypes.Structure):  # ucp_request_param_t
    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", VOID_P),
        ("cb", VOID_P),
        ("datatype", ctypes.c_uint64),
        ("user_data", VOID_P),
        ("reply_buffer", VOID_P),
        ("memory_type", ctypes.c_int),
        ("recv_info", VOID_P),
        ("memh", VOID_P),
        ("_spare", ctypes.c_uint8 * 64),
    ]


class _TagRecvInfo(ctypes.Structure):  # ucp_tag_recv_info_t
    _fields_ = [("sender_tag", ctypes.c_uint64), ("length", ctypes.c_size_t)]


# ucp_dt_iov_t {void *buffer; size_t length;} as numpy records: an iov list is built with
# vectorised numpy and handed to UCX without a Python loop per entry.
IOV_DTYPE = np.dtype([("buffer", np.uint64), ("length", np.uint64)])
_DATATYPE_IOV = 2  # ucp_dt_make_iov()
_OP_FIELD_DATATYPE = 1 << 3


def declare(library: ctypes.CDLL, name: str, restype: object, *argtypes: object) -> None:
    fn = getattr(library, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)


_c = ctypes
declare(lib, "ucp_request_check_status", STATUS, VOID_P)
declare(
    lib,
    "ucp_tag_send_nbx",
    VOID_P,
    VOID_P,
    VOID_P,
    _c.c_size_t,
    _c.c_uint64,
    _c.POINTER(RequestParam),
)
declare(
    lib,
    "ucp_tag_probe_nb",
    VOID_P,
    VOID_P,
    _c.c_uint64,
    _c.c_uint64,
    _c.c_int,
    _c.POINTER(_TagRecvInfo),
)
declare(
    lib,
    "ucp_tag_msg_recv_nbx",
    VOID_P,
    VOID_P,
    VOID_P,
    _c.c_size_t,
    VOID_P,
    _c.POINTER(RequestParam),
)
declare(lib, "ucp_request_free", None, VOID_P)
declare(ucs, "ucs_status_string", _c.c_char_p, STATUS)


class UcpError(Exception):
    """A UCP call failed; `status` is the ucs_status_t."""

    def __init__(self, what: str, status: int) -> None:
        self.status = status
        super().__init__(f"{what}: {status_string(status)} ({status})")


def status_string(status: int) -> str:
    return ucs.ucs_status_string(status).decode()


def check(what: str, status: int) -> None:
    if status != UCS_OK:
        raise UcpError(what, status)


# ---- requests -----------------------------------------------------------------------------------
class RawRequest:
    """A UCP status pointer as `UcxWorker.submit` wants it (`completed`, `check_error()`).
    The request is freed as soon as it is seen complete."""

    def __init__(self, what: str, ptr: int | None) -> None:
        self._what = what
        self._ptr: int | None = None
        self._status = UCS_OK
        if ptr is None:
            return  # completed in place
        if ptr >= _PTR_ERR_MIN:
            self._status = ptr - (1 << 64)
            return
        self._ptr = ptr

    @property
    def completed(self) -> bool:
        if self._ptr is None:
            return True
        status = lib.ucp_request_check_status(self._ptr)
        if status == UCS_INPROGRESS:
            return False
        self._status = status
        lib.ucp_request_free(self._ptr)
        self._ptr = None
        return True

    def check_error(self) -> None:
        if self.completed and self._status != UCS_OK:
            raise UcpError(self._what, self._status)


# ---- tagged messages ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Probe:
    """An unexpected tagged message taken off the worker (`probe`): receive it exactly once with
    `recv_probed` (a truncating 1-byte receive drains it)."""

    message: int  # ucp_tag_message_h
    tag: int
    length: int


def probe(worker_handle: int, tag: int | None = None) -> Probe | None:
    """The oldest unexpected tagged message (tag `tag`; None: any), off the unexpected queue."""
    info = _TagRecvInfo()
    mask = 0 if tag is None else (1 << 64) - 1
    message = lib.ucp_tag_probe_nb(worker_handle, tag or 0, mask, 1, ctypes.byref(info))
    if not message:
        return None
    return Probe(message, info.sender_tag, info.length)


def tag_send(ep_handle: int, address: int, nbytes: int, tag: int) -> RawRequest:
    """Send `nbytes` at `address` (host or device memory, UCX detects which)."""
    return RawRequest(
        "ucp_tag_send_nbx", lib.ucp_tag_send_nbx(ep_handle, address, nbytes, tag, _PLAIN)
    )


def tag_send_iov(ep_handle: int, iov: np.ndarray, tag: int) -> RawRequest:
    """Send the concatenation of the `iov` (IOV_DTYPE) entries as one tagged message."""
    return RawRequest(
        "ucp_tag_send_nbx(iov)",
        lib.ucp_tag_send_nbx(ep_handle, iov.ctypes.data, len(iov), tag, _IOV),
    )


def recv_probed(worker_handle: int, p: Probe, address: int, nbytes: int) -> RawRequest:
    """Receive a probed message into `nbytes` at `address` (a shorter buffer truncates: the
    request fails with 'Message truncated', the sender's completes normally)."""
    return RawRequest(
        "ucp_tag_msg_recv_nbx",
        lib.ucp_tag_msg_recv_nbx(worker_handle, address, nbytes, p.message, _PLAIN),
    )


def recv_probed_iov(worker_handle: int, p: Probe, iov: np.ndarray) -> RawRequest:
    """Receive a probed message scattered over the `iov` (IOV_DTYPE) entries, in order."""
    return RawRequest(
        "ucp_tag_msg_recv_nbx(iov)",
        lib.ucp_tag_msg_recv_nbx(worker_handle, iov.ctypes.data, len(iov), p.message, _IOV),
    )


def iov(base: int, spans: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """An iov list (IOV_DTYPE) over `spans` ((offsets, lengths) from KvLayout.block_spans)
    of the memory starting at address `base`."""
    offsets, lengths = spans
    out = np.empty(len(offsets), dtype=IOV_DTYPE)
    out["buffer"] = base + offsets
    out["length"] = lengths
    return out


_PLAIN = RequestParam()  # contiguous buffer, no callback: completion is polled
_IOV = RequestParam()
_IOV.op_attr_mask = _OP_FIELD_DATATYPE
_IOV.datatype = _DATATYPE_IOV
