// go-localstate watches the kpx agent's node-local state API (kpx.localstate.v1) with deltas
// and keeps a local copy of the state: an example of a client in another language than the
// agent's, built on the code generated from the .proto (localstatev1/, ./generate.sh).
//
//	go-localstate [-target unix:///run/proxy-agent/state.sock] [-dump FILE] [-deltas=false]
//
// After each response it applies, it logs one line on stderr and, with -dump, writes the copy
// to FILE (atomically) as the protobuf JSON of a full WatchResponse. SIGUSR1 prints the copy
// on stdout; SIGTERM and SIGINT stop it (exit 0) with a last dump.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"math"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"

	pb "kpx.dev/examples/go-localstate/localstatev1"
)

const defaultTarget = "unix:///run/proxy-agent/state.sock"

func main() {
	target := flag.String("target", envOr("KPX_STATE_API", defaultTarget),
		"the agent's state API (default: $KPX_STATE_API, else "+defaultTarget+")")
	dump := flag.String("dump", "", "write the copy here (JSON) after each applied response")
	deltas := flag.Bool("deltas", true, "ask for deltas (false: a full state each time)")
	flag.Parse()
	log.SetFlags(0)
	log.SetPrefix("go-localstate: ")

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	usr1 := make(chan os.Signal, 1)
	signal.Notify(usr1, syscall.SIGUSR1)

	// A full state is larger than gRPC's default 4 MB limit on received messages from a few
	// thousand Service ports on: take messages of any size.
	conn, err := grpc.NewClient(*target,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(math.MaxInt32)))
	if err != nil {
		log.Fatalf("%s: %v", *target, err)
	}
	defer conn.Close()

	w := &watcher{client: pb.NewLocalStateClient(conn), deltas: *deltas, dump: *dump,
		state: &State{}, usr1: usr1}
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		applied, err := w.watch(ctx)
		if ctx.Err() != nil {
			break
		}
		if applied {
			backoff = 100 * time.Millisecond
		}
		log.Printf("watch ended (%v); again in %v", err, backoff)
		select {
		case <-ctx.Done():
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 5*time.Second)
	}
	if err := w.write(); err != nil {
		log.Fatalf("dump: %v", err)
	}
	log.Printf("stopped at revision %d", w.state.Revision)
}

type watcher struct {
	client pb.LocalStateClient
	deltas bool
	dump   string
	state  *State
	usr1   chan os.Signal
}

// watch runs one stream until it fails or ctx ends; applied: at least one response applied.
func (w *watcher) watch(ctx context.Context) (applied bool, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stream, err := w.client.Watch(ctx)
	if err != nil {
		return false, err
	}
	responses := make(chan *pb.WatchResponse)
	failed := make(chan error, 1)
	go func() {
		for {
			r, err := stream.Recv()
			if err != nil {
				failed <- err
				return
			}
			select {
			case responses <- r:
			case <-ctx.Done():
				return
			}
		}
	}()
	request := func() error {
		return stream.Send(&pb.WatchRequest{
			InstanceId: w.state.InstanceID, Revision: w.state.Revision, WantDeltas: w.deltas})
	}
	if err := request(); err != nil {
		return false, err
	}
	for {
		select {
		case <-ctx.Done():
			return applied, ctx.Err()
		case err := <-failed:
			if errors.Is(err, io.EOF) {
				err = errors.New("the agent closed the stream")
			}
			return applied, err
		case <-w.usr1:
			if err := w.print(os.Stdout); err != nil {
				log.Printf("print: %v", err)
			}
		case r := <-responses:
			if err := w.state.Apply(r); err != nil {
				w.state = &State{} // start again from a full state
				return applied, err
			}
			applied = true
			kind := "delta"
			if r.GetFull() {
				kind = "full"
			}
			log.Printf("revision %d of %s (%s: %d set, %d deleted): %d service ports",
				r.GetRevision(), r.GetInstanceId(), kind, len(r.GetServicePorts()),
				len(r.GetDeleted()), len(w.state.ServicePorts))
			if err := w.write(); err != nil {
				return applied, fmt.Errorf("dump: %w", err)
			}
			if err := request(); err != nil {
				return applied, err
			}
		}
	}
}

func (w *watcher) encode() ([]byte, error) {
	return protojson.MarshalOptions{Multiline: true}.Marshal(w.state.AsFull())
}

func (w *watcher) print(out io.Writer) error {
	data, err := w.encode()
	if err == nil {
		_, err = fmt.Fprintf(out, "%s\n", data)
	}
	return err
}

// write replaces the dump file with the copy (nothing without -dump or before a first state).
func (w *watcher) write() error {
	if w.dump == "" || w.state.Revision == 0 {
		return nil
	}
	data, err := w.encode()
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(w.dump), ".go-localstate-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), w.dump)
}

func envOr(name, fallback string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return fallback
}
