package main

import (
	"cmp"
	"fmt"
	"slices"

	pb "kpx.dev/examples/go-localstate/localstatev1"
)

// portKey is a ServicePortKey as a comparable value (a map key).
type portKey struct {
	namespace, name, portName string
	protocol                  pb.Protocol
	family                    uint32
}

func keyOf(k *pb.ServicePortKey) portKey {
	return portKey{k.GetNamespace(), k.GetName(), k.GetPortName(), k.GetProtocol(), k.GetFamily()}
}

func compareKeys(a, b portKey) int {
	return cmp.Or(
		cmp.Compare(a.namespace, b.namespace),
		cmp.Compare(a.name, b.name),
		cmp.Compare(a.portName, b.portName),
		cmp.Compare(a.protocol, b.protocol),
		cmp.Compare(a.family, b.family),
	)
}

// State is the local copy of the agent's node-local state at one revision.
type State struct {
	InstanceID   string
	Revision     uint64
	Node         *pb.NodeInfo
	Settings     *pb.ProxySettings
	NodeFacts    []*pb.NodeFacts
	ServicePorts map[portKey]*pb.ServicePort
}

// Apply applies one WatchResponse: a full state replaces the copy; a delta must follow the
// revision held (else an error: the caller starts again from an empty copy).
func (s *State) Apply(r *pb.WatchResponse) error {
	if r.GetFull() {
		s.ServicePorts = make(map[portKey]*pb.ServicePort, len(r.GetServicePorts()))
	} else {
		if r.GetInstanceId() != s.InstanceID || r.GetRevision() != s.Revision+1 {
			return fmt.Errorf("delta to revision %d of %s, but revision %d of %q is held",
				r.GetRevision(), r.GetInstanceId(), s.Revision, s.InstanceID)
		}
		for _, k := range r.GetDeleted() {
			delete(s.ServicePorts, keyOf(k))
		}
	}
	for _, p := range r.GetServicePorts() {
		s.ServicePorts[keyOf(p.GetKey())] = p
	}
	s.InstanceID, s.Revision = r.GetInstanceId(), r.GetRevision()
	s.Node, s.Settings, s.NodeFacts = r.GetNode(), r.GetSettings(), r.GetNodeFacts()
	return nil
}

// AsFull is the copy as the full WatchResponse the agent would send for it (Service ports
// ordered by key): what -dump writes, comparable with a fresh full state message for message.
func (s *State) AsFull() *pb.WatchResponse {
	keys := make([]portKey, 0, len(s.ServicePorts))
	for k := range s.ServicePorts {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, compareKeys)
	ports := make([]*pb.ServicePort, len(keys))
	for i, k := range keys {
		ports[i] = s.ServicePorts[k]
	}
	return &pb.WatchResponse{
		InstanceId:   s.InstanceID,
		Revision:     s.Revision,
		Full:         true,
		Node:         s.Node,
		Settings:     s.Settings,
		ServicePorts: ports,
		NodeFacts:    s.NodeFacts,
	}
}
