package volume

import (
	"encoding/binary"

	"golang.org/x/sys/unix"
)

// nfs4ACLXattr is the NFSv4 ACL of a file on an NFSv4 mount, as the Linux client shows it:
// reading it is a GETACL to the server, writing it a SETACL. Its value is the XDR of the
// attribute (RFC 7530 nfsace4[]).
const nfs4ACLXattr = "system.nfs4_acl"

// ACE types, flags and access bits of RFC 7530 (section 6.2.1) that modeOnlyACL reads.
const (
	ace4Allow = 0
	ace4Deny  = 1

	ace4FileInherit      = 0x1
	ace4DirectoryInherit = 0x2
	ace4InheritOnly      = 0x8
	ace4IdentifierGroup  = 0x40

	ace4ReadData        = 0x1
	ace4WriteData       = 0x2
	ace4AppendData      = 0x4
	ace4Execute         = 0x20
	ace4DeleteChild     = 0x40
	ace4ReadAttributes  = 0x80
	ace4WriteAttributes = 0x100
	ace4ReadACL         = 0x20000
	ace4WriteACL        = 0x40000
	ace4Synchronize     = 0x100000
)

// The access bits the Linux NFS server (nfsd, fs/nfsd/nfs4acl.c) derives from a mode: what
// everyone is granted, what the owner is granted besides, and what each of r, w and x stands
// for (w also grants DELETE_CHILD on a directory).
const (
	aceAnyone = ace4ReadAttributes | ace4ReadACL | ace4Synchronize
	aceOwner  = ace4WriteAttributes | ace4WriteACL
	aceRead   = ace4ReadData
	aceWrite  = ace4WriteData | ace4AppendData
	aceExec   = ace4Execute
)

type ace4 struct {
	typ, flag, mask uint32
	who             string
}

// parseNFS4ACL decodes the value of nfs4ACLXattr; false if it is not one whole and well formed.
func parseNFS4ACL(b []byte) ([]ace4, bool) {
	u32 := func() (uint32, bool) {
		if len(b) < 4 {
			return 0, false
		}
		v := binary.BigEndian.Uint32(b)
		b = b[4:]
		return v, true
	}
	n, ok := u32()
	if !ok || uint64(n) > uint64(len(b)/16) { // an ACE is 16 bytes at least
		return nil, false
	}
	aces := make([]ace4, 0, n)
	for range n {
		var a ace4
		var l uint32
		var ok1, ok2, ok3, ok4 bool
		a.typ, ok1 = u32()
		a.flag, ok2 = u32()
		a.mask, ok3 = u32()
		l, ok4 = u32()
		padded := (uint64(l) + 3) &^ 3
		if !ok1 || !ok2 || !ok3 || !ok4 || padded > uint64(len(b)) {
			return nil, false
		}
		a.who, b = string(b[:l]), b[padded:]
		aces = append(aces, a)
	}
	return aces, len(b) == 0
}

// modeOnlyACL reports whether the NFSv4 ACL acl of a file of mode says nothing that the mode
// does not, as the Linux NFS server writes such an ACL, so that a copy given that mode has the
// same ACL without a SETACL: every entry allows or denies, names OWNER@, GROUP@ or EVERYONE@
// (no user, no group), inherits nothing (no inheritance flag: a directory's entries for what
// is made in it), and uses only the access bits of the mode's mapping (aceAnyone, aceOwner,
// aceRead, aceWrite, aceExec, and DELETE_CHILD for a directory), and, read in order as a
// server reads it, grants the owner (in the group or not), a member of the group and anyone
// else exactly the bits of their part of the mode. Anything else, an ACL it cannot decode
// included, is copied: a SETACL too many costs a round trip, one too few a permission.
func modeOnlyACL(acl []byte, mode uint32) bool {
	aces, ok := parseNFS4ACL(acl)
	if !ok {
		return false
	}
	dir := mode&unix.S_IFMT == unix.S_IFDIR
	known := uint32(aceAnyone | aceOwner | aceRead | aceWrite | aceExec)
	if dir {
		known |= ace4DeleteChild
	}
	for _, a := range aces {
		if a.typ != ace4Allow && a.typ != ace4Deny || a.mask&^known != 0 ||
			a.who != "OWNER@" && a.who != "GROUP@" && a.who != "EVERYONE@" ||
			a.flag != 0 && (a.flag != ace4IdentifierGroup || a.who != "GROUP@") {
			return false
		}
	}
	want := func(bits uint32, owner bool) uint32 {
		m := uint32(aceAnyone)
		if owner {
			m |= aceOwner
		}
		if bits&4 != 0 {
			m |= aceRead
		}
		if bits&2 != 0 {
			m |= aceWrite
			if dir {
				m |= ace4DeleteChild
			}
		}
		if bits&1 != 0 {
			m |= aceExec
		}
		return m
	}
	perm := mode & 0o777
	for _, who := range []struct {
		owner, group bool
		want         uint32
	}{
		{true, false, want(perm>>6, true)},
		{true, true, want(perm>>6, true)},
		{false, true, want(perm>>3, false)},
		{false, false, want(perm, false)},
	} {
		if grantedBy(aces, who.owner, who.group) != who.want {
			return false
		}
	}
	return true
}

// grantedBy is the access NFSv4 ACL aces grants a user who is the file's owner or not, and a
// member of its group or not: each bit is decided by the first entry for the user naming it
// (RFC 7530 section 6.2.1), and is not granted if none does.
func grantedBy(aces []ace4, owner, group bool) uint32 {
	var allowed, decided uint32
	for _, a := range aces {
		if !(a.who == "EVERYONE@" || a.who == "OWNER@" && owner || a.who == "GROUP@" && group) {
			continue
		}
		bits := a.mask &^ decided
		if a.typ == ace4Allow {
			allowed |= bits
		}
		decided |= bits
	}
	return allowed
}

// handsDownACL reports whether a directory whose NFSv4 ACL is acl may give entries of it to
// what is made in it: it has an inheritance flag, or cannot be decoded.
func handsDownACL(acl []byte) bool {
	aces, ok := parseNFS4ACL(acl)
	if !ok {
		return true
	}
	for _, a := range aces {
		if a.flag&(ace4FileInherit|ace4DirectoryInherit|ace4InheritOnly) != 0 {
			return true
		}
	}
	return false
}
