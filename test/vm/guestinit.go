package vm

// Mount tags of the two 9p shares, and where the second one appears in the guest.
const (
	tagHostRoot = "hostroot"
	tagShare    = "dirpvvm"
	// GuestShareDir is the writable share in the guest: the command script comes in here and
	// the output, exit status and result files go out.
	GuestShareDir = "/dirpv-vm"
	// GuestResultsDir is where a guest command leaves files for the host (Result.Files); the
	// guest gets it as $DIRPV_VM_RESULTS.
	GuestResultsDir = GuestShareDir + "/results"
	// stopFile, in the share, is Machine.Stop's request to the guest command to end; the guest
	// gets its path as $DIRPV_VM_STOP.
	stopFile = "stop"
)

// initScript is the initramfs's /init (busybox sh). It loads the modules, puts a tmpfs overlay
// on the host's root (9p, read-only), mounts the share and hands over to the share's stage2.sh
// running on the host's own /bin/sh. Any failure powers the VM off, which the host reports
// with the console log.
const initScript = `#!/bin/busybox sh
/bin/busybox mkdir -p /dev /proc /sys /lower /rw /newroot
/bin/busybox mount -t devtmpfs devtmpfs /dev
exec 0</dev/console 1>/dev/console 2>&1
export PATH=/bin
/bin/busybox --install -s /bin
fail() { echo "dirpv-vm init: $*"; poweroff -f; sleep 60; }
mount -t proc proc /proc || fail "mount /proc"
for m in $(cat /modules/order); do
	insmod /modules/$m || fail "insmod $m"
done
ip link set lo up || fail "loopback up"
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 ` + tagHostRoot + ` /lower || fail "mount host root over 9p"
mount -t tmpfs -o mode=0755 tmpfs /rw || fail "mount tmpfs"
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot || fail "mount overlay"
mkdir -p /newroot` + GuestShareDir + `
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 ` + tagShare + ` /newroot` + GuestShareDir + ` || fail "mount share over 9p"
umount /proc
mount --move /dev /newroot/dev || fail "move /dev"
exec switch_root /newroot /bin/sh ` + GuestShareDir + `/stage2.sh
`

// stage2 is the guest's PID 1 after switch_root, run by the host's /bin/sh. %[1]s is the
// module tree on the host root, %[2]s the kernel version, %[3]s the working directory, %[4]s
// extra environment assignments, %[5]s the quoted command and %[6]s the network setup (":"
// without a network), whose failure is the command's. The exit status goes to rc
// (written under another name and renamed, so the host never reads half of it); then the VM
// powers off through sysrq, as the host's poweroff needs an init system.
const stage2 = `#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sysfs /sys
# The guest's /tmp is its own tmpfs, which would hide a checkout under the host's /tmp (CI
# clones anywhere): the top directory holding the working directory is carried over.
wd=%[3]s
case "$wd" in /tmp/?*) keep=/tmp/$(echo "$wd" | cut -d/ -f3); mkdir -p /.dirpv-keep && mount --bind "$keep" /.dirpv-keep ;; *) keep= ;; esac
mount -t tmpfs -o mode=1777 tmpfs /tmp
if [ -n "$keep" ]; then mkdir -p "$keep" && mount --move /.dirpv-keep "$keep"; fi
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mkdir -p /lib/modules
ln -sfn %[1]s /lib/modules/%[2]s
hostname dirpv-vm
mkdir -p ` + GuestResultsDir + `
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
export DIRPV_IN_VM=1 DIRPV_VM_RESULTS=` + GuestResultsDir + ` DIRPV_VM_STOP=` + GuestShareDir + "/" + stopFile + `
%[4]s
: > ` + GuestShareDir + `/booted
{ %[6]s && cd "$wd" && %[5]s; } > ` + GuestShareDir + `/output 2>&1 < /dev/null
echo $? > ` + GuestShareDir + `/rc.tmp
mv ` + GuestShareDir + `/rc.tmp ` + GuestShareDir + `/rc
sync
echo o > /proc/sysrq-trigger
sleep 60
`
