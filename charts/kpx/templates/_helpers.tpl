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

{{/* The operator's image: repository:tag, the tag defaulting to the chart's appVersion. */}}
{{- define "kpx.operator.image" -}}
{{- $image := .Values.operator.image -}}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag) -}}
{{- end -}}
