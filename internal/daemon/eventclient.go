package daemon

import (
	"k8s.io/client-go/kubernetes"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	typedeventsv1 "k8s.io/client-go/kubernetes/typed/events/v1"
)

// eventsApart is a client whose events go through a clientset of their own, and so through a
// rate limiter of their own, as kube-scheduler's do. An event broadcaster writes its queue one
// event at a time as fast as its client lets it: after a burst of claims (three events each)
// its backlog took every token of a shared limiter, and each PV create waited its turn behind
// events of claims long bound. Every broadcaster in the process (the lib's, external-resizer's,
// external-snapshotter's, the capacity controller's and dirpv's own) reaches events through
// CoreV1().Events or EventsV1(), so they all get the events' limiter.
type eventsApart struct {
	kubernetes.Interface
	events kubernetes.Interface
}

// withEventsApart returns client with its events sent through events.
func withEventsApart(client, events kubernetes.Interface) kubernetes.Interface {
	return eventsApart{Interface: client, events: events}
}

func (c eventsApart) CoreV1() typedcorev1.CoreV1Interface {
	return coreEventsApart{CoreV1Interface: c.Interface.CoreV1(), events: c.events.CoreV1()}
}

func (c eventsApart) EventsV1() typedeventsv1.EventsV1Interface { return c.events.EventsV1() }

type coreEventsApart struct {
	typedcorev1.CoreV1Interface
	events typedcorev1.CoreV1Interface
}

func (c coreEventsApart) Events(namespace string) typedcorev1.EventInterface {
	return c.events.Events(namespace)
}
