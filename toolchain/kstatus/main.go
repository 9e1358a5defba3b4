// Command kstatus prints the kstatus of one Kubernetes object read as JSON or YAML on stdin, as
// sigs.k8s.io/cli-utils computes it (status.Compute: what Flux, kpt and `helm --wait` with
// kstatus read), and optionally what Flux's Kustomization `healthCheckExprs` CEL expressions
// say about the same object.
//
//	kstatus < object.yaml
//	kstatus -current EXPR [-in-progress EXPR] [-failed EXPR] < object.yaml
//
// It prints one JSON object: {"status": ..., "message": ..., "cel": ...} ("cel" only with
// -current). The CEL evaluation follows Flux (fluxcd/pkg/runtime/cel, RFC 0009): an object
// whose status.observedGeneration differs from metadata.generation is InProgress without
// evaluating anything; otherwise inProgress, failed, current are evaluated in that order and
// the first true one wins; none true: InProgress. The environment has the options Flux sets
// (cel-go with the strings, sets and encoders extensions, the object's top-level fields as
// variables, expressions parsed, not type-checked).
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/google/cel-go/cel"
	"github.com/google/cel-go/common/types"
	"github.com/google/cel-go/ext"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	kjson "k8s.io/apimachinery/pkg/util/json"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
	"sigs.k8s.io/yaml"
)

type result struct {
	Status  string `json:"status"`
	Message string `json:"message"`
	CEL     string `json:"cel,omitempty"`
}

func program(expr string) (cel.Program, error) {
	env, err := cel.NewEnv(
		cel.HomogeneousAggregateLiterals(),
		cel.EagerlyValidateDeclarations(true),
		cel.DefaultUTCTimeZone(true),
		cel.CrossTypeNumericComparisons(true),
		cel.OptionalTypes(),
		ext.Strings(),
		ext.Sets(),
		ext.Encoders(),
	)
	if err != nil {
		return nil, err
	}
	ast, issues := env.Parse(expr)
	if issues != nil && issues.Err() != nil {
		return nil, fmt.Errorf("cannot parse %q: %s", expr, issues.String())
	}
	return env.Program(ast, cel.EvalOptions(cel.OptOptimize), cel.InterruptCheckFrequency(100))
}

func evalCEL(obj map[string]any, inProgress, failed, current string) (string, error) {
	u := unstructured.Unstructured{Object: obj}
	observed, found, err := unstructured.NestedInt64(obj, "status", "observedGeneration")
	if err != nil {
		return "", err
	}
	if found && observed != u.GetGeneration() {
		return status.InProgressStatus.String(), nil
	}
	for _, e := range []struct {
		expr   string
		status status.Status
	}{
		{inProgress, status.InProgressStatus},
		{failed, status.FailedStatus},
		{current, status.CurrentStatus},
	} {
		if e.expr == "" {
			continue
		}
		prog, err := program(e.expr)
		if err != nil {
			return "", err
		}
		val, _, err := prog.ContextEval(context.Background(), obj)
		if err != nil {
			return "", fmt.Errorf("cannot evaluate %q: %w", e.expr, err)
		}
		b, ok := val.(types.Bool)
		if !ok {
			return "", fmt.Errorf("%q is not a boolean: %v", e.expr, val)
		}
		if b {
			return e.status.String(), nil
		}
	}
	return status.InProgressStatus.String(), nil
}

func run() error {
	current := flag.String("current", "", "Flux healthCheckExprs `current` CEL expression")
	inProgress := flag.String("in-progress", "", "Flux healthCheckExprs `inProgress` CEL expression")
	failed := flag.String("failed", "", "Flux healthCheckExprs `failed` CEL expression")
	flag.Parse()
	if (*inProgress != "" || *failed != "") && *current == "" {
		return fmt.Errorf("-current is required with -in-progress or -failed (as in Flux)")
	}
	data, err := io.ReadAll(os.Stdin)
	if err != nil {
		return err
	}
	doc, err := yaml.YAMLToJSON(data)
	if err != nil {
		return fmt.Errorf("stdin is not JSON or YAML: %w", err)
	}
	var obj map[string]any
	// apimachinery's decoder keeps whole numbers int64, as the apiserver's objects have them.
	if err := kjson.Unmarshal(doc, &obj); err != nil {
		return fmt.Errorf("stdin is not a JSON or YAML object: %w", err)
	}
	if obj == nil {
		return fmt.Errorf("stdin holds no object")
	}
	res, err := status.Compute(&unstructured.Unstructured{Object: obj})
	if err != nil {
		return err
	}
	out := result{Status: res.Status.String(), Message: res.Message}
	if *current != "" {
		if out.CEL, err = evalCEL(obj, *inProgress, *failed, *current); err != nil {
			return err
		}
	}
	return json.NewEncoder(os.Stdout).Encode(out)
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "kstatus:", err)
		os.Exit(1)
	}
}
