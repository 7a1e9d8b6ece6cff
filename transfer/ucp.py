"""The few UCP C calls that ucxx 0.52's Python API lacks, through ctypes on ucxx's own libucp.

Why: ucxx's `UCXListener.create` listens on every interface (a KV receiver binds the address an
operator configured); ucxx has no iov datatype (the KV push gathers from and scatters into pool
blocks with one UCX operation each). The UCP API is a stable C ABI (structs start with a
`field_mask`, later versions only append fields): the layouts below (UCX 1.21, pinned through
ucxx 0.52.*) stay valid, with spare room. Not thread safe: use it on the progressing thread.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from dataclasses import dataclass

import libucx
import numpy as np

from transfer.env import configure_ucx_env
from transfer.protocol import join_address, pack_sockaddr, parse_sockaddr, resolve_bind_address

log = logging.getLogger(__name__)

configure_ucx_env()  # before UCX is loaded: it reads part of its environment on load
# The libraries ucxx itself loads (same resolution, so the same handles and globals).
_ucs, _ucs_signal, _uct, _ucp = libucx.load_library()

_c = ctypes
_vp = ctypes.c_void_p

UCS_OK = 0
UCS_INPROGRESS = 1
_UCS_ERR_LAST = -100
_PTR_ERR_MIN = (1 << 64) + _UCS_ERR_LAST  # status pointers at or above this are errors

_LISTENER_FIELD_SOCK_ADDR = 1 << 0
_LISTENER_FIELD_CONN_HANDLER = 1 << 2
_LISTENER_ATTR_SOCKADDR = 1 << 0
_CONN_REQUEST_ATTR_CLIENT_ADDR = 1 << 0
_EP_FIELD_ERR_MODE = 1 << 1
_EP_FIELD_ERR_HANDLER = 1 << 2
_EP_FIELD_CONN_REQUEST = 1 << 6
_ERR_MODE_PEER = 1
_OP_FIELD_FLAGS = 1 << 4
_EP_CLOSE_FLAG_FORCE = 1 << 0
_EP_ATTR_LOCAL_SOCKADDR = 1 << 1

_CONN_CB = ctypes.CFUNCTYPE(None, _vp, _vp)  # (ucp_conn_request_h, void *arg)
_ERR_CB = ctypes.CFUNCTYPE(None, _vp, _vp, ctypes.c_int8)  # (arg, ucp_ep_h, ucs_status_t)


class _SockAddr(ctypes.Structure):  # ucs_sock_addr_t
    _fields_ = [("addr", _vp), ("addrlen", ctypes.c_uint32)]


class _Handler(ctypes.Structure):  # ucp_listener_conn_handler_t / ucp_err_handler_t
    _fields_ = [("cb", _vp), ("arg", _vp)]


class _ListenerParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("sockaddr", _SockAddr),
        ("accept_handler", _Handler),
        ("conn_handler", _Handler),
        ("_spare", ctypes.c_uint8 * 64),
    ]


class _SockAddrAttr(ctypes.Structure):  # ucp_listener_attr_t and ucp_conn_request_attr_t
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("sockaddr", ctypes.c_uint8 * 128),  # struct sockaddr_storage
        ("client_id", ctypes.c_uint64),
        ("_spare", ctypes.c_uint8 * 64),
    ]


class _EpAttr(ctypes.Structure):  # ucp_ep_attr_t, read up to local_sockaddr
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("name", ctypes.c_char * 32),  # UCP_ENTITY_NAME_MAX
        ("local_sockaddr", ctypes.c_uint8 * 128),
        ("_rest", ctypes.c_uint8 * 512),  # remote_sockaddr, transports, user_data, later fields
    ]


class _EpParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("address", _vp),
        ("err_mode", ctypes.c_int),
        ("err_handler", _Handler),
        ("user_data", _vp),
        ("flags", ctypes.c_uint),
        ("sockaddr", _SockAddr),
        ("conn_request", _vp),
        ("name", ctypes.c_char_p),
        ("local_sockaddr", _SockAddr),
        ("_spare", ctypes.c_uint8 * 64),
    ]


class _RequestParam(ctypes.Structure):  # ucp_request_param_t
    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", _vp),
        ("cb", _vp),
        ("datatype", ctypes.c_uint64),
        ("user_data", _vp),
        ("reply_buffer", _vp),
        ("memory_type", ctypes.c_int),
        ("recv_info", _vp),
        ("memh", _vp),
        ("_spare", ctypes.c_uint8 * 64),
    ]


class _TagRecvInfo(ctypes.Structure):  # ucp_tag_recv_info_t
    _fields_ = [("sender_tag", ctypes.c_uint64), ("length", ctypes.c_size_t)]


# ucp_dt_iov_t {void *buffer; size_t length;} as numpy records: an iov list is built with
# vectorised numpy and handed to UCX without a Python loop per entry.
IOV_DTYPE = np.dtype([("buffer", np.uint64), ("length", np.uint64)])
_DATATYPE_IOV = 2  # ucp_dt_make_iov()
_OP_FIELD_DATATYPE = 1 << 3


def _declare(lib: ctypes.CDLL, name: str, restype: object, *argtypes: object) -> None:
    fn = getattr(lib, name)
    fn.restype = restype
    fn.argtypes = list(argtypes)


_status = ctypes.c_int8
_declare(_ucp, "ucp_listener_create", _status, _vp, _c.POINTER(_ListenerParams), _c.POINTER(_vp))
_declare(_ucp, "ucp_listener_query", _status, _vp, _c.POINTER(_SockAddrAttr))
_declare(_ucp, "ucp_listener_destroy", None, _vp)
_declare(_ucp, "ucp_conn_request_query", _status, _vp, _c.POINTER(_SockAddrAttr))
_declare(_ucp, "ucp_ep_create", _status, _vp, _c.POINTER(_EpParams), _c.POINTER(_vp))
_declare(_ucp, "ucp_ep_query", _status, _vp, _c.POINTER(_EpAttr))
_declare(_ucp, "ucp_ep_close_nbx", _vp, _vp, _c.POINTER(_RequestParam))
_declare(_ucp, "ucp_request_check_status", _status, _vp)
_declare(
    _ucp, "ucp_tag_send_nbx", _vp, _vp, _vp, _c.c_size_t, _c.c_uint64, _c.POINTER(_RequestParam)
)
_declare(
    _ucp, "ucp_tag_probe_nb", _vp, _vp, _c.c_uint64, _c.c_uint64, _c.c_int, _c.POINTER(_TagRecvInfo)
)
_declare(_ucp, "ucp_tag_msg_recv_nbx", _vp, _vp, _vp, _c.c_size_t, _vp, _c.POINTER(_RequestParam))
_declare(_ucp, "ucp_request_free", None, _vp)
_declare(_ucs, "ucs_status_string", _c.c_char_p, _status)


class UcpError(Exception):
    """A UCP call failed; `status` is the ucs_status_t."""

    def __init__(self, what: str, status: int) -> None:
        self.status = status
        super().__init__(f"{what}: {status_string(status)} ({status})")


def status_string(status: int) -> str:
    return _ucs.ucs_status_string(status).decode()


def _check(what: str, status: int) -> None:
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
        status = _ucp.ucp_request_check_status(self._ptr)
        if status == UCS_INPROGRESS:
            return False
        self._status = status
        _ucp.ucp_request_free(self._ptr)
        self._ptr = None
        return True

    def check_error(self) -> None:
        if self.completed and self._status != UCS_OK:
            raise UcpError(self._what, self._status)


# ---- endpoints and listener ---------------------------------------------------------------------
class ServerEndpoint:
    """A raw UCP endpoint accepted by `BoundListener`; close it exactly once with `close()`."""

    def __init__(self, handle: int, peer: str) -> None:
        self.handle = handle
        self.peer = peer  # "ip:port" of the connecting side, for logs
        self.failed = False
        self.closing = False

    def close(self, force: bool = False) -> RawRequest:
        """Start closing (flush, or FORCE: drop outstanding operations at once)."""
        if self.closing:
            raise RuntimeError("endpoint already closing")
        self.closing = True
        param = _RequestParam()
        param.op_attr_mask = _OP_FIELD_FLAGS
        param.flags = _EP_CLOSE_FLAG_FORCE if force or self.failed else 0
        return RawRequest("ucp_ep_close_nbx", _ucp.ucp_ep_close_nbx(self.handle, param))


class BoundListener:
    """A UCP listener bound to one address (`host`; "0.0.0.0" / "::" for every interface).

    `on_endpoint(ep)` runs inside worker progress for each accepted connection; `on_error(ep)`
    when an accepted endpoint fails (peer gone). Both must only do bookkeeping (close the
    endpoint later, from the loop)."""

    def __init__(
        self,
        worker_handle: int,
        host: str,
        port: int,
        on_endpoint: Callable[[ServerEndpoint], None],
        on_error: Callable[[ServerEndpoint], None],
    ) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"UCX port {port} outside 0..65535")
        self._worker = worker_handle
        self._on_endpoint = on_endpoint
        self._on_error = on_error
        self._endpoints: dict[int, ServerEndpoint] = {}  # raw handle -> endpoint
        # ctypes callbacks must outlive the listener and every endpoint
        self._conn_cb = _CONN_CB(self._on_conn_request)
        self._err_cb = _ERR_CB(self._on_ep_error)
        family, packed_ip = resolve_bind_address(host)
        raw = pack_sockaddr(family, packed_ip, port)
        self._addr = ctypes.create_string_buffer(raw, len(raw))
        params = _ListenerParams()
        params.field_mask = _LISTENER_FIELD_SOCK_ADDR | _LISTENER_FIELD_CONN_HANDLER
        params.sockaddr.addr = ctypes.addressof(self._addr)
        params.sockaddr.addrlen = len(self._addr)
        params.conn_handler.cb = ctypes.cast(self._conn_cb, _vp)
        handle = _vp()
        _check(
            f"ucp_listener_create on {host}:{port}",
            _ucp.ucp_listener_create(worker_handle, params, ctypes.byref(handle)),
        )
        self._handle: int | None = handle.value
        attr = _SockAddrAttr()
        attr.field_mask = _LISTENER_ATTR_SOCKADDR
        _check("ucp_listener_query", _ucp.ucp_listener_query(self._handle, attr))
        self.ip, self.port = parse_sockaddr(bytes(attr.sockaddr))

    @property
    def endpoints(self) -> list[ServerEndpoint]:
        return list(self._endpoints.values())

    def forget(self, ep: ServerEndpoint) -> None:
        """Drop a closed endpoint from the table (after its close request completed)."""
        self._endpoints.pop(ep.handle, None)

    def destroy(self) -> None:
        """Stop accepting; close the accepted endpoints first."""
        if self._handle is not None:
            _ucp.ucp_listener_destroy(self._handle)
            self._handle = None

    def _on_conn_request(self, conn_request: int, _arg: int) -> None:
        peer = _client_address(conn_request)
        params = _EpParams()
        params.field_mask = _EP_FIELD_CONN_REQUEST | _EP_FIELD_ERR_MODE | _EP_FIELD_ERR_HANDLER
        params.conn_request = conn_request
        params.err_mode = _ERR_MODE_PEER
        params.err_handler.cb = ctypes.cast(self._err_cb, _vp)
        handle = _vp()
        status = _ucp.ucp_ep_create(self._worker, params, ctypes.byref(handle))
        if status != UCS_OK:
            log.warning("cannot accept UCX connection from %s: %s", peer, status_string(status))
            return
        ep = ServerEndpoint(handle.value, peer)
        self._endpoints[ep.handle] = ep
        try:
            self._on_endpoint(ep)
        except Exception:  # an exception must not unwind into C
            log.exception("UCX accept callback failed")

    def _on_ep_error(self, _arg: int, ep_handle: int, status: int) -> None:
        ep = self._endpoints.get(ep_handle)
        if ep is None:
            return
        ep.failed = True
        log.info("UCX peer %s failed: %s", ep.peer, status_string(status))
        try:
            self._on_error(ep)
        except Exception:
            log.exception("UCX endpoint error callback failed")


def local_address(ep_handle: int) -> str | None:
    """The "ip:port" of a connecting endpoint's socket (its listener's `peer`), or None."""
    attr = _EpAttr()
    attr.field_mask = _EP_ATTR_LOCAL_SOCKADDR
    if _ucp.ucp_ep_query(ep_handle, ctypes.byref(attr)) != UCS_OK:
        return None
    return join_address(*parse_sockaddr(bytes(attr.local_sockaddr)))


def _client_address(conn_request: int) -> str:
    attr = _SockAddrAttr()
    attr.field_mask = _CONN_REQUEST_ATTR_CLIENT_ADDR
    if _ucp.ucp_conn_request_query(conn_request, attr) != UCS_OK:
        return "?"
    return join_address(*parse_sockaddr(bytes(attr.sockaddr)))


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
    message = _ucp.ucp_tag_probe_nb(worker_handle, tag or 0, mask, 1, ctypes.byref(info))
    if not message:
        return None
    return Probe(message, info.sender_tag, info.length)


def tag_send(ep_handle: int, address: int, nbytes: int, tag: int) -> RawRequest:
    """Send `nbytes` at `address` (host or device memory, UCX detects which)."""
    return RawRequest(
        "ucp_tag_send_nbx", _ucp.ucp_tag_send_nbx(ep_handle, address, nbytes, tag, _PLAIN)
    )


def tag_send_iov(ep_handle: int, iov: np.ndarray, tag: int) -> RawRequest:
    """Send the concatenation of the `iov` (IOV_DTYPE) entries as one tagged message."""
    return RawRequest(
        "ucp_tag_send_nbx(iov)",
        _ucp.ucp_tag_send_nbx(ep_handle, iov.ctypes.data, len(iov), tag, _IOV),
    )


def recv_probed(worker_handle: int, p: Probe, address: int, nbytes: int) -> RawRequest:
    """Receive a probed message into `nbytes` at `address` (a shorter buffer truncates: the
    request fails with 'Message truncated', the sender's completes normally)."""
    return RawRequest(
        "ucp_tag_msg_recv_nbx",
        _ucp.ucp_tag_msg_recv_nbx(worker_handle, address, nbytes, p.message, _PLAIN),
    )


def recv_probed_iov(worker_handle: int, p: Probe, iov: np.ndarray) -> RawRequest:
    """Receive a probed message scattered over the `iov` (IOV_DTYPE) entries, in order."""
    return RawRequest(
        "ucp_tag_msg_recv_nbx(iov)",
        _ucp.ucp_tag_msg_recv_nbx(worker_handle, iov.ctypes.data, len(iov), p.message, _IOV),
    )


def iov(base: int, spans: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """An iov list (IOV_DTYPE) over `spans` ((offsets, lengths) from KvLayout.block_spans)
    of the memory starting at address `base`."""
    offsets, lengths = spans
    out = np.empty(len(offsets), dtype=IOV_DTYPE)
    out["buffer"] = base + offsets
    out["length"] = lengths
    return out


_PLAIN = _RequestParam()  # contiguous buffer, no callback: completion is polled
_IOV = _RequestParam()
_IOV.op_attr_mask = _OP_FIELD_DATATYPE
_IOV.datatype = _DATATYPE_IOV
