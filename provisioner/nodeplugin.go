package provisioner

import (
	"context"
	"slices"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
)

// ReasonNodePluginMissing is the event reason on a local claim placed on a node where no dirpv
// node plugin runs.
const ReasonNodePluginMissing = "NodePluginMissing"

// nodePluginCheckPeriod is how often one pending claim's node is looked up again: the lib
// shows the controller every claim on each update and resync, and one event per period is
// enough to tell the user.
const nodePluginCheckPeriod = 5 * time.Minute

// nodePluginSeenFor is how long a node found running the plugin is trusted to still run it,
// so that a burst of claims on one node costs one lookup, not one per claim.
const nodePluginSeenFor = time.Minute

// claimChecks remembers when each pending claim was last checked, so that a claim the lib
// shows the controller on every update and resync gets one check (and at most one event) per
// nodePluginCheckPeriod.
type claimChecks struct {
	mu   sync.Mutex
	last map[types.UID]time.Time
	// pruned is when last was last swept of claims checked a period ago or more. The lib asks
	// about every pending claim on each resync: a sweep per call would cost the whole map on
	// each, quadratic in the claims pending; one sweep per period is O(1) per call amortised,
	// and keeps no more than two periods' claims.
	pruned time.Time
	// swept counts the entries the sweeps looked at, for tests.
	swept int
}

// due reports whether the claim should be checked now, and if so records that it was.
func (c *claimChecks) due(uid types.UID, now time.Time) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if t, ok := c.last[uid]; ok && now.Sub(t) < nodePluginCheckPeriod {
		return false
	}
	if c.last == nil {
		c.last = map[types.UID]time.Time{}
		c.pruned = now
	}
	// Claims that got bound or deleted are never asked about again: forget them by age.
	if now.Sub(c.pruned) >= nodePluginCheckPeriod {
		for u, t := range c.last {
			c.swept++
			if now.Sub(t) >= nodePluginCheckPeriod {
				delete(c.last, u)
			}
		}
		c.pruned = now
	}
	c.last[uid] = now
	return true
}

// nodePluginChecks remembers when each pending claim's node was last looked up, and which
// nodes were recently seen running the plugin.
type nodePluginChecks struct {
	claims claimChecks
	mu     sync.Mutex
	nodes  map[string]time.Time
}

// due reports whether the claim's node should be looked up now, and if so records that it was.
func (c *nodePluginChecks) due(uid types.UID, node string, now time.Time) bool {
	c.mu.Lock()
	t, seen := c.nodes[node]
	c.mu.Unlock()
	if seen && now.Sub(t) < nodePluginSeenFor {
		return false
	}
	return c.claims.due(uid, now)
}

// runsPlugin records that node was seen running the plugin.
func (c *nodePluginChecks) runsPlugin(node string, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.nodes == nil {
		c.nodes = map[string]time.Time{}
	}
	for n, t := range c.nodes {
		if now.Sub(t) >= nodePluginSeenFor {
			delete(c.nodes, n)
		}
	}
	c.nodes[node] = now
}

// checkNodePlugin records an event on a local claim whose selected node has no dirpv node
// plugin registered (its CSINode lists no dirpv driver). Only that node's instance could
// serve the claim, so without this the claim would stay Pending with no word from dirpv.
func (p *Provisioner) checkNodePlugin(ctx context.Context, claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass, node string) {
	if p.cfg.Events == nil || !p.nodePlugins.due(claim.UID, node, time.Now()) {
		return
	}
	logger := klog.FromContext(ctx).WithValues("claim", klog.KObj(claim), "node", node)
	ctx, cancel := context.WithTimeout(ctx, apiTimeout)
	defer cancel()
	csiNode, err := p.cfg.Client.StorageV1().CSINodes().Get(ctx, node, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
	case err != nil:
		logger.Error(err, "Cannot tell whether the claim's node runs the dirpv node plugin")
		return
	case slices.ContainsFunc(csiNode.Spec.Drivers, func(d storagev1.CSINodeDriver) bool { return d.Name == p.cfg.DriverName }):
		p.nodePlugins.runsPlugin(node, time.Now())
		return
	}
	logger.Info("Local claim placed on a node without the dirpv node plugin")
	p.cfg.Events.Eventf(claim, v1.EventTypeWarning, ReasonNodePluginMissing,
		"node %s runs no %s node plugin (its CSINode lists no driver %s), so nothing there creates this claim's volume of local StorageClass %s: "+
			"make the dirpv node DaemonSet run on %s (node selector, tolerations), or let the pod run on another node",
		node, p.cfg.DriverName, p.cfg.DriverName, class.Name, node)
}

// ReasonUnservableClass is the event reason on a WaitForFirstConsumer claim that dirpv cannot
// serve wherever it goes: its class or the claim itself is refused. A reason of dirpv's own, so
// that users tell it from the lib's ProvisioningFailed, which comes only once a claim is placed.
const ReasonUnservableClass = "UnservableClaim"

// checkUnplaced records an event on a pending WaitForFirstConsumer claim that dirpv could not
// provision wherever it went, because its class or the claim is wrong (a bad parameter,
// Block, an access mode). No instance publishes capacity for a class it cannot parse, so the
// scheduler places no such claim, and the lib provisions no WaitForFirstConsumer claim until
// it is placed: without this the claim would stay Pending with no word from dirpv, its pod
// reporting only that no node has free storage.
func (p *Provisioner) checkUnplaced(ctx context.Context, claim *v1.PersistentVolumeClaim, class *storagev1.StorageClass) {
	if p.cfg.Events == nil {
		return
	}
	_, err := checkClassAndClaim(class, claim)
	if err == nil || !p.unplaced.due(claim.UID, time.Now()) {
		return
	}
	klog.FromContext(ctx).Info("Claim that dirpv cannot serve on any node", "claim", klog.KObj(claim), "class", class.Name, "reason", err.Error())
	p.cfg.Events.Eventf(claim, v1.EventTypeWarning, ReasonUnservableClass,
		"dirpv cannot provision this claim of StorageClass %s on any node, so the scheduler places it nowhere: %v", class.Name, err)
}
