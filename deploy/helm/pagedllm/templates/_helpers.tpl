{{/* Resource names: <release>-pagedllm, or the release name alone when it already says pagedllm. */}}
{{- define "pagedllm.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The labels that select this release's pods; never change them after an install. */}}
{{- define "pagedllm.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pagedllm.labels" -}}
{{ include "pagedllm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pagedllm.modelClaim" -}}
{{- .Values.modelCache.persistence.existingClaim | default (printf "%s-models" (include "pagedllm.fullname" .)) -}}
{{- end -}}

{{/* Seconds the kubelet waits after SIGTERM: the preStop pause, the server's drain, a margin. */}}
{{- define "pagedllm.terminationGracePeriodSeconds" -}}
{{- $s := .Values.server -}}
{{- add (int $s.preStopSleepSeconds) (int $s.shutdownTimeout) (int $s.terminationGraceMarginSeconds) -}}
{{- end -}}
