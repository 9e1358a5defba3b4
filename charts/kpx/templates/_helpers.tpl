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
