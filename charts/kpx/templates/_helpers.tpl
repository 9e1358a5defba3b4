{{/*
Labels of every object: the component's name and part-of, as in operator/manifests, plus the
labels Helm charts conventionally add. Pod templates and selectors carry only the component's.
Usage: include "kpx.labels" (list $ "kpx-operator")
*/}}
{{- define "kpx.labels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ index . 1 }}
app.kubernetes.io/part-of: kpx
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" $root.Chart.Name $root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/*
An image reference from {repository, tag}: repository:tag, or repository@sha256:... when the tag
is a digest (sha256:... or @sha256:...); the tag defaults to the chart's appVersion.
Usage: include "kpx.image" (list $ .Values.operator.image)
*/}}
{{- define "kpx.image" -}}
{{- $root := index . 0 -}}
{{- $image := index . 1 -}}
{{- $tag := default $root.Chart.AppVersion $image.tag | trimPrefix "@" -}}
{{- if hasPrefix "sha256:" $tag -}}
{{- printf "%s@%s" $image.repository $tag -}}
{{- else -}}
{{- printf "%s:%s" $image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/*
The prefix of every object's name: fullnameOverride, else nameOverride, else "kpx" (the release
name is not part of it: kpx runs once per cluster). Objects are <fullname>-operator and
<fullname>-agent; with neither override, kpx-operator and kpx-agent as in operator/manifests.
*/}}
{{- define "kpx.fullname" -}}
{{- default (default "kpx" .Values.nameOverride) .Values.fullnameOverride | trunc 48 | trimSuffix "-" -}}
{{- end -}}

{{- define "kpx.operatorName" -}}
{{- printf "%s-operator" (include "kpx.fullname" .) -}}
{{- end -}}

{{- define "kpx.agentName" -}}
{{- printf "%s-agent" (include "kpx.fullname" .) -}}
{{- end -}}

{{/* The operator's ServiceAccount: operator.serviceAccount.name, else <fullname>-operator. */}}
{{- define "kpx.operatorServiceAccount" -}}
{{- default (include "kpx.operatorName" .) .Values.operator.serviceAccount.name -}}
{{- end -}}

{{/* The agents' ServiceAccount (the operator's --agent-service-account): <fullname>-agent. */}}
{{- define "kpx.agentServiceAccount" -}}
{{- include "kpx.agentName" . -}}
{{- end -}}

{{/*
The agents' arguments the operator appends to every agent's command (--agent-arg): -v for
agents.logLevel debug, then agents.extraArgs.
*/}}
{{- define "kpx.agentArgs" -}}
{{- $args := list -}}
{{- if eq .Values.agents.logLevel "debug" }}{{ $args = append $args "-v" }}{{ end -}}
{{- range .Values.agents.extraArgs }}{{ $args = append $args . }}{{ end -}}
{{- toJson $args -}}
{{- end -}}
