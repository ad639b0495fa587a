package benchkit

import (
	"context"
	"fmt"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// Publisher calls a node plugin's NodePublishVolume and NodeUnpublishVolume through its real
// CSI socket, as kubelet calls them.
type Publisher struct {
	conn *grpc.ClientConn
	node csi.NodeClient
	req  *csi.NodePublishVolumeRequest
}

// DialPublisher connects to the CSI socket for publishing req (volume, target, capability,
// context) over and over; Close ends it.
func DialPublisher(socket string, req *csi.NodePublishVolumeRequest) (*Publisher, error) {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, fmt.Errorf("dial CSI socket %s: %w", socket, err)
	}
	return &Publisher{conn: conn, node: csi.NewNodeClient(conn), req: req}, nil
}

// Cycle is one NodePublishVolume and NodeUnpublishVolume of the volume.
func (p *Publisher) Cycle(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	_, err := p.node.NodePublishVolume(ctx, p.req)
	if err == nil {
		_, err = p.node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: p.req.VolumeId, TargetPath: p.req.TargetPath})
	}
	if err != nil {
		return fmt.Errorf("publish/unpublish: %w", err)
	}
	return nil
}

// Close closes the connection.
func (p *Publisher) Close() { p.conn.Close() }
