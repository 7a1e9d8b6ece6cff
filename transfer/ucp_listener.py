"""A UCP listener bound to one address, and the endpoints it accepts, through ctypes
(transfer/ucp.py has the library): ucxx's `UCXListener.create` listens on every interface, and a
KV receiver binds the address an operator configured."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

from transfer.protocol import join_address, pack_sockaddr, parse_sockaddr, resolve_bind_address
from transfer.ucp import (
    OP_FIELD_FLAGS,
    STATUS,
    UCS_OK,
    VOID_P,
    Handler,
    RawRequest,
    RequestParam,
    SockAddr,
    check,
    declare,
    lib,
    status_string,
)

log = logging.getLogger(__name__)

_LISTENER_FIELD_SOCK_ADDR = 1 << 0
_LISTENER_FIELD_CONN_HANDLER = 1 << 2
_LISTENER_ATTR_SOCKADDR = 1 << 0
_CONN_REQUEST_ATTR_CLIENT_ADDR = 1 << 0
_EP_FIELD_ERR_MODE = 1 << 1
_EP_FIELD_ERR_HANDLER = 1 << 2
_EP_FIELD_CONN_REQUEST = 1 << 6
_ERR_MODE_PEER = 1
_EP_CLOSE_FLAG_FORCE = 1 << 0
_EP_ATTR_LOCAL_SOCKADDR = 1 << 1

_CONN_CB = ctypes.CFUNCTYPE(None, VOID_P, VOID_P)  # (ucp_conn_request_h, void *arg)
_ERR_CB = ctypes.CFUNCTYPE(None, VOID_P, VOID_P, ctypes.c_int8)  # (arg, ucp_ep_h, ucs_status_t)


class _ListenerParams(ctypes.Structure):
    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("sockaddr", SockAddr),
        ("accept_handler", Handler),
        ("conn_handler", Handler),
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
        ("address", VOID_P),
        ("err_mode", ctypes.c_int),
        ("err_handler", Handler),
        ("user_data", VOID_P),
        ("flags", ctypes.c_uint),
        ("sockaddr", SockAddr),
        ("conn_request", VOID_P),
        ("name", ctypes.c_char_p),
        ("local_sockaddr", SockAddr),
        ("_spare", ctypes.c_uint8 * 64),
    ]


_c = ctypes
declare(lib, "ucp_listener_create", STATUS, VOID_P, _c.POINTER(_ListenerParams), _c.POINTER(VOID_P))
declare(lib, "ucp_listener_query", STATUS, VOID_P, _c.POINTER(_SockAddrAttr))
declare(lib, "ucp_listener_destroy", None, VOID_P)
declare(lib, "ucp_conn_request_query", STATUS, VOID_P, _c.POINTER(_SockAddrAttr))
declare(lib, "ucp_ep_create", STATUS, VOID_P, _c.POINTER(_EpParams), _c.POINTER(VOID_P))
declare(lib, "ucp_ep_query", STATUS, VOID_P, _c.POINTER(_EpAttr))
declare(lib, "ucp_ep_close_nbx", VOID_P, VOID_P, _c.POINTER(RequestParam))


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
        param = RequestParam()
        param.op_attr_mask = OP_FIELD_FLAGS
        param.flags = _EP_CLOSE_FLAG_FORCE if force or self.failed else 0
        return RawRequest("ucp_ep_close_nbx", lib.ucp_ep_close_nbx(self.handle, param))


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
        params.conn_handler.cb = ctypes.cast(self._conn_cb, VOID_P)
        handle = VOID_P()
        check(
            f"ucp_listener_create on {host}:{port}",
            lib.ucp_listener_create(worker_handle, params, ctypes.byref(handle)),
        )
        self._handle: int | None = handle.value
        attr = _SockAddrAttr()
        attr.field_mask = _LISTENER_ATTR_SOCKADDR
        check("ucp_listener_query", lib.ucp_listener_query(self._handle, attr))
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
            lib.ucp_listener_destroy(self._handle)
            self._handle = None

    def _on_conn_request(self, conn_request: int, _arg: int) -> None:
        peer = _client_address(conn_request)
        params = _EpParams()
        params.field_mask = _EP_FIELD_CONN_REQUEST | _EP_FIELD_ERR_MODE | _EP_FIELD_ERR_HANDLER
        params.conn_request = conn_request
        params.err_mode = _ERR_MODE_PEER
        params.err_handler.cb = ctypes.cast(self._err_cb, VOID_P)
        handle = VOID_P()
        status = lib.ucp_ep_create(self._worker, params, ctypes.byref(handle))
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
    if lib.ucp_ep_query(ep_handle, ctypes.byref(attr)) != UCS_OK:
        return None
    return join_address(*parse_sockaddr(bytes(attr.local_sockaddr)))


def _client_address(conn_request: int) -> str:
    attr = _SockAddrAttr()
    attr.field_mask = _CONN_REQUEST_ATTR_CLIENT_ADDR
    if lib.ucp_conn_request_query(conn_request, attr) != UCS_OK:
        return "?"
    return join_address(*parse_sockaddr(bytes(attr.sockaddr)))
