{{/* Name prefix of every object: the release name, or "<release>-gpupool" when it lacks "gpupool". */}}
{{- define "gpupool.fullname" -}}
{{- if contains "gpupool" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-gpupool" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gpupool.labels" -}}
app.kubernetes.io/name: gpupool
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "gpupool.operator.name" -}}{{ include "gpupool.fullname" . }}-operator{{- end -}}
{{- define "gpupool.agent.name" -}}{{ include "gpupool.fullname" . }}-agent{{- end -}}

{{- define "gpupool.operator.selector" -}}
app.kubernetes.io/name: gpupool
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "gpupool.agent.selector" -}}
app.kubernetes.io/name: gpupool
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: node-agent
{{- end -}}

{{/* The agent's namespace: agent.namespace.name, or "<release>-node". */}}
{{- define "gpupool.agent.namespace" -}}
{{- default (printf "%s-node" .Release.Name) .Values.agent.namespace.name -}}
{{- end -}}

{{/* image: repository[:tag][@digest], the tag defaulting to the appVersion. */}}
{{- define "gpupool.image" -}}
{{- $tag := default .root.Chart.AppVersion .image.tag -}}
{{- if .image.digest -}}
{{- printf "%s:%s@%s" .image.repository $tag .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}
{{- end -}}
