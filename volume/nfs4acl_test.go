package volume

import (
	"encoding/binary"
	"testing"

	"golang.org/x/sys/unix"
)

// xdrACL encodes aces as the value of system.nfs4_acl.
func xdrACL(aces ...ace4) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(len(aces)))
	for _, a := range aces {
		b = binary.BigEndian.AppendUint32(b, a.typ)
		b = binary.BigEndian.AppendUint32(b, a.flag)
		b = binary.BigEndian.AppendUint32(b, a.mask)
		b = binary.BigEndian.AppendUint32(b, uint32(len(a.who)))
		b = append(b, a.who...)
		b = append(b, make([]byte, (4-len(a.who)%4)%4)...)
	}
	return b
}

// TestModeOnlyACL: the ACLs the Linux NFS server shows for a mode are taken as the mode's,
// deny entries included; an ACL that names a user, inherits, grants a part of the mode more or
// less than the mode says, uses another bit, or does not decode, is not.
func TestModeOnlyACL(t *testing.T) {
	const (
		file = unix.S_IFREG
		dir  = unix.S_IFDIR
		rw   = aceRead | aceWrite
	)
	allow := func(who string, mask uint32) ace4 { return ace4{typ: ace4Allow, mask: mask, who: who} }
	deny := func(who string, mask uint32) ace4 { return ace4{typ: ace4Deny, mask: mask, who: who} }
	// What nfsd shows for a file of mode 0644.
	f644 := []ace4{allow("OWNER@", aceAnyone|aceOwner|rw), allow("GROUP@", aceAnyone|aceRead), allow("EVERYONE@", aceAnyone|aceRead)}
	for _, c := range []struct {
		name string
		acl  []byte
		mode uint32
		want bool
	}{
		{"0644 file", xdrACL(f644...), file | 0o644, true},
		{"0644 file, setuid", xdrACL(f644...), file | 0o4644, true},
		{"0644 file's ACL on a 0640 file", xdrACL(f644...), file | 0o640, false},
		{"0644 file's ACL on a 0664 file", xdrACL(f644...), file | 0o664, false},
		{"0700 dir", xdrACL(allow("OWNER@", aceAnyone|aceOwner|rw|aceExec|ace4DeleteChild),
			allow("GROUP@", aceAnyone), allow("EVERYONE@", aceAnyone)), dir | 0o700, true},
		{"DELETE_CHILD on a file", xdrACL(allow("OWNER@", aceAnyone|aceOwner|rw|ace4DeleteChild),
			allow("GROUP@", aceAnyone|aceRead), allow("EVERYONE@", aceAnyone|aceRead)), file | 0o644, false},
		// 0460: the owner is denied what the group is granted, should it be in the group.
		{"0460 file", xdrACL(deny("OWNER@", aceWrite), allow("OWNER@", aceAnyone|aceOwner|aceRead),
			allow("GROUP@", aceAnyone|rw), allow("EVERYONE@", aceAnyone)), file | 0o460, true},
		{"0460 file without the owner's deny", xdrACL(allow("OWNER@", aceAnyone|aceOwner|aceRead),
			allow("GROUP@", aceAnyone|rw), allow("EVERYONE@", aceAnyone)), file | 0o460, false},
		// 0604: the group is denied what everyone else is granted.
		{"0604 file", xdrACL(allow("OWNER@", aceAnyone|aceOwner|rw), allow("GROUP@", aceAnyone),
			ace4{typ: ace4Deny, flag: ace4IdentifierGroup, mask: aceRead, who: "GROUP@"}, allow("EVERYONE@", aceAnyone|aceRead)), file | 0o604, true},
		{"0604 file without the group's deny", xdrACL(allow("OWNER@", aceAnyone|aceOwner|rw), allow("GROUP@", aceAnyone),
			allow("EVERYONE@", aceAnyone|aceRead)), file | 0o604, false},
		{"named user", xdrACL(append(f644[:1:1], allow("alice@localdomain", aceAnyone|rw), f644[1], f644[2])...), file | 0o644, false},
		{"named group", xdrACL(append(f644[:2:2], ace4{typ: ace4Allow, flag: ace4IdentifierGroup, mask: aceAnyone | aceRead, who: "staff@localdomain"}, f644[2])...), file | 0o644, false},
		{"inheritance flag", xdrACL(append(f644, ace4{typ: ace4Allow, flag: ace4FileInherit | ace4InheritOnly, mask: aceAnyone, who: "EVERYONE@"})...), dir | 0o644, false},
		{"audit entry", xdrACL(append(f644, ace4{typ: 2, mask: aceRead, who: "EVERYONE@"})...), file | 0o644, false},
		{"WRITE_OWNER", xdrACL(allow("OWNER@", aceAnyone|aceOwner|rw|0x80000), f644[1], f644[2]), file | 0o644, false},
		{"READ_ACL denied to everyone", xdrACL(f644[0], f644[1], allow("EVERYONE@", aceRead)), file | 0o644, false},
		{"write without append", xdrACL(allow("OWNER@", aceAnyone|aceOwner|aceRead|ace4WriteData), f644[1], f644[2]), file | 0o644, false},
		{"named attributes", xdrACL(allow("OWNER@", aceAnyone|aceOwner|rw|0x8|0x10), f644[1], f644[2]), file | 0o644, false},
		{"empty ACL", xdrACL(), file | 0o644, false},
		{"truncated", xdrACL(f644...)[:30], file | 0o644, false},
		{"trailing bytes", append(xdrACL(f644...), 0, 0, 0, 0), file | 0o644, false},
		{"huge count", []byte{0xff, 0xff, 0xff, 0xff}, file | 0o644, false},
	} {
		if got := modeOnlyACL(c.acl, c.mode); got != c.want {
			t.Errorf("%s: modeOnlyACL = %v, want %v", c.name, got, c.want)
		}
	}
	if handsDownACL(xdrACL(f644...)) {
		t.Error("handsDownACL of a mode's ACL = true")
	}
	if !handsDownACL(xdrACL(append(f644, ace4{typ: ace4Allow, flag: ace4DirectoryInherit, mask: aceAnyone, who: "OWNER@"})...)) {
		t.Error("handsDownACL of an ACL with an inheritable entry = false")
	}
	if !handsDownACL([]byte{0, 0}) {
		t.Error("handsDownACL of an ACL it cannot decode = false")
	}
}
