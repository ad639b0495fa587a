// Package nfs3 is a small, handle-based NFSv3/MOUNTv3/portmap client for the
// test harness and the test-only FUSE mount helper.
//
// It reuses the XDR codec and protocol types of github.com/willscott/go-nfs-client
// but brings its own ONC RPC transport: the library's transport retries a call
// up to 100 times with a 5 s wait each, so a dead or stopped server hangs a
// caller for minutes, and it can close a reply channel twice under concurrent
// disconnects. Here every call carries a deadline (from its context, or the
// client's default timeout), a failed or timed-out connection is dropped and
// redialled on the next call, and nothing is retried behind the caller's back
// (NFS operations such as CREATE and REMOVE are not idempotent).
package nfs3

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/willscott/go-nfs-client/nfs/rpc"
	"github.com/willscott/go-nfs-client/nfs/xdr"
)

// DefaultTimeout bounds a call whose context has no deadline.
const DefaultTimeout = 5 * time.Second

// maxRecord bounds one RPC reply record so a corrupt length cannot make us
// allocate gigabytes.
const maxRecord = 8 << 20

var xidCounter atomic.Uint32

func init() {
	xidCounter.Store(uint32(time.Now().UnixNano()))
}

// RPCError is an RPC-level failure (the server did not run the procedure).
type RPCError struct {
	Prog, Proc uint32
	Msg        string
}

func (e *RPCError) Error() string {
	return fmt.Sprintf("rpc prog %d proc %d: %s", e.Prog, e.Proc, e.Msg)
}

// ErrTimeout is returned (wrapped) when a call does not complete before its deadline.
var ErrTimeout = errors.New("rpc call timed out")

// ErrConnLost is returned (wrapped) when the connection failed before a
// reply came: the server may or may not have run the call.
var ErrConnLost = errors.New("rpc connection lost")

// Client is one ONC RPC over TCP client with multiplexed calls.
type Client struct {
	addr    string
	timeout time.Duration

	mu   sync.Mutex // guards conn; held while dialling so only one dial happens
	conn *conn
}

// NewClient returns a client for host:port. It does not dial until the first call.
func NewClient(addr string, timeout time.Duration) *Client {
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	return &Client{addr: addr, timeout: timeout}
}

// Close drops the current connection; a later call dials again.
func (c *Client) Close() {
	c.mu.Lock()
	cn := c.conn
	c.conn = nil
	c.mu.Unlock()
	if cn != nil {
		cn.fail(errors.New("client closed"))
	}
}

type conn struct {
	nc  net.Conn
	wmu sync.Mutex // serialises record writes

	mu      sync.Mutex
	pending map[uint32]chan []byte
	err     error // set once the connection is dead
}

func (cn *conn) fail(err error) {
	cn.mu.Lock()
	if cn.err != nil {
		cn.mu.Unlock()
		return
	}
	cn.err = err
	pending := cn.pending
	cn.pending = nil
	cn.mu.Unlock()
	_ = cn.nc.Close()
	for _, ch := range pending {
		close(ch)
	}
}

func (cn *conn) readLoop() {
	r := bufio.NewReaderSize(cn.nc, 256<<10)
	for {
		rec, err := readRecord(r)
		if err != nil {
			cn.fail(fmt.Errorf("reading reply: %w", err))
			return
		}
		if len(rec) < 4 {
			cn.fail(errors.New("short rpc reply"))
			return
		}
		xid := binary.BigEndian.Uint32(rec)
		cn.mu.Lock()
		ch, ok := cn.pending[xid]
		delete(cn.pending, xid)
		cn.mu.Unlock()
		if ok {
			ch <- rec[4:] // buffered, never blocks
		}
	}
}

// readRecord reads one RPC record, joining record-marking fragments.
func readRecord(r io.Reader) ([]byte, error) {
	var out []byte
	for {
		var hdr [4]byte
		if _, err := io.ReadFull(r, hdr[:]); err != nil {
			return nil, err
		}
		h := binary.BigEndian.Uint32(hdr[:])
		n := int(h & 0x7fffffff)
		if len(out)+n > maxRecord {
			return nil, fmt.Errorf("rpc record of %d bytes too large", len(out)+n)
		}
		start := len(out)
		out = append(out, make([]byte, n)...)
		if _, err := io.ReadFull(r, out[start:]); err != nil {
			return nil, err
		}
		if h&0x80000000 != 0 {
			return out, nil
		}
	}
}

func (c *Client) getConn(ctx context.Context) (*conn, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.conn != nil {
		c.conn.mu.Lock()
		dead := c.conn.err != nil
		c.conn.mu.Unlock()
		if !dead {
			return c.conn, nil
		}
		c.conn = nil
	}
	d := net.Dialer{}
	nc, err := d.DialContext(ctx, "tcp", c.addr)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", c.addr, err)
	}
	cn := &conn{nc: nc, pending: map[uint32]chan []byte{}}
	go cn.readLoop()
	c.conn = cn
	return cn, nil
}

// dropConn forgets cn (if still current) and closes it, so that the next
// call starts on a fresh connection: after a timeout we cannot tell a slow
// server from a half-dead TCP connection.
func (c *Client) dropConn(cn *conn, err error) {
	c.mu.Lock()
	if c.conn == cn {
		c.conn = nil
	}
	c.mu.Unlock()
	cn.fail(err)
}

type callMsg struct {
	Xid     uint32
	MsgType uint32 // 0 = CALL
	rpc.Header
}

// Call runs one procedure and returns a reader positioned at the procedure's
// result. args may be nil for procedures without arguments.
func (c *Client) Call(ctx context.Context, prog, vers, proc uint32, cred rpc.Auth, args any) (*bytes.Reader, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.timeout)
		defer cancel()
	}
	xid := xidCounter.Add(1)
	var buf bytes.Buffer
	buf.Write([]byte{0, 0, 0, 0}) // record mark, filled in below
	if err := xdr.Write(&buf, &callMsg{Xid: xid, Header: rpc.Header{
		Rpcvers: 2, Prog: prog, Vers: vers, Proc: proc, Cred: cred, Verf: rpc.AuthNull,
	}}); err != nil {
		return nil, fmt.Errorf("encoding rpc header: %w", err)
	}
	if args != nil {
		if err := xdr.Write(&buf, args); err != nil {
			return nil, fmt.Errorf("encoding rpc args: %w", err)
		}
	}
	msg := buf.Bytes()
	binary.BigEndian.PutUint32(msg, uint32(len(msg)-4)|0x80000000)

	cn, err := c.getConn(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%w: %v", ErrTimeout, err)
		}
		return nil, err
	}
	ch := make(chan []byte, 1)
	cn.mu.Lock()
	if cn.err != nil {
		err := cn.err
		cn.mu.Unlock()
		return nil, fmt.Errorf("connection to %s: %w: %w", c.addr, ErrConnLost, err)
	}
	cn.pending[xid] = ch
	cn.mu.Unlock()

	dl, _ := ctx.Deadline()
	cn.wmu.Lock()
	_ = cn.nc.SetWriteDeadline(dl)
	_, err = cn.nc.Write(msg)
	cn.wmu.Unlock()
	if err != nil {
		c.dropConn(cn, err)
		return nil, fmt.Errorf("sending rpc to %s: %w: %w", c.addr, ErrConnLost, err)
	}

	var rep []byte
	select {
	case r, ok := <-ch:
		if !ok {
			cn.mu.Lock()
			err := cn.err
			cn.mu.Unlock()
			return nil, fmt.Errorf("connection to %s: %w: %w", c.addr, ErrConnLost, err)
		}
		rep = r
	case <-ctx.Done():
		if errors.Is(ctx.Err(), context.Canceled) {
			// The caller gave up; the connection is fine, others may use it.
			cn.mu.Lock()
			delete(cn.pending, xid)
			cn.mu.Unlock()
			return nil, fmt.Errorf("rpc prog %d proc %d to %s: %w", prog, proc, c.addr, ctx.Err())
		}
		c.dropConn(cn, ErrTimeout)
		return nil, fmt.Errorf("rpc prog %d proc %d to %s: %w", prog, proc, c.addr, ErrTimeout)
	}
	return parseReply(rep, prog, proc)
}

func parseReply(rep []byte, prog, proc uint32) (*bytes.Reader, error) {
	r := bytes.NewReader(rep)
	var hdr struct {
		MsgType   uint32
		ReplyStat uint32
	}
	if err := xdr.Read(r, &hdr); err != nil {
		return nil, fmt.Errorf("decoding rpc reply: %w", err)
	}
	if hdr.MsgType != 1 {
		return nil, &RPCError{prog, proc, fmt.Sprintf("message type %d is not a reply", hdr.MsgType)}
	}
	if hdr.ReplyStat != 0 { // MSG_DENIED
		var rs uint32
		_ = xdr.Read(r, &rs)
		return nil, &RPCError{prog, proc, fmt.Sprintf("call denied (reject_stat %d)", rs)}
	}
	var verf rpc.Auth
	if err := xdr.Read(r, &verf); err != nil {
		return nil, fmt.Errorf("decoding rpc verifier: %w", err)
	}
	var acceptStat uint32
	if err := xdr.Read(r, &acceptStat); err != nil {
		return nil, fmt.Errorf("decoding rpc accept status: %w", err)
	}
	switch acceptStat {
	case 0:
		return r, nil
	case 1:
		return nil, &RPCError{prog, proc, "PROG_UNAVAIL"}
	case 2:
		return nil, &RPCError{prog, proc, "PROG_MISMATCH"}
	case 3:
		return nil, &RPCError{prog, proc, "PROC_UNAVAIL"}
	case 4:
		return nil, &RPCError{prog, proc, "GARBAGE_ARGS"}
	default:
		return nil, &RPCError{prog, proc, fmt.Sprintf("accept_stat %d", acceptStat)}
	}
}

// GetPort asks the portmapper at host:111 for the TCP port of prog/vers.
func GetPort(ctx context.Context, host string, prog, vers uint32) (int, error) {
	c := NewClient(net.JoinHostPort(host, "111"), DefaultTimeout)
	defer c.Close()
	r, err := c.Call(ctx, rpc.PmapProg, rpc.PmapVers, rpc.PmapProcGetPort, rpc.AuthNull,
		&rpc.Mapping{Prog: prog, Vers: vers, Prot: rpc.IPProtoTCP})
	if err != nil {
		return 0, fmt.Errorf("portmapper GETPORT(%d, v%d): %w", prog, vers, err)
	}
	port, err := xdr.ReadUint32(r)
	if err != nil {
		return 0, fmt.Errorf("decoding GETPORT reply: %w", err)
	}
	if port == 0 {
		return 0, fmt.Errorf("program %d v%d is not registered with the portmapper on %s", prog, vers, host)
	}
	return int(port), nil
}

// Ping runs the NULL procedure of prog/vers: the cheapest proof that the
// server's RPC service for that program is up.
func Ping(ctx context.Context, addr string, prog, vers uint32) error {
	c := NewClient(addr, DefaultTimeout)
	defer c.Close()
	_, err := c.Call(ctx, prog, vers, 0, rpc.AuthNull, nil)
	return err
}
