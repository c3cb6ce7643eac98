{{/* Names: <release>-cube unless the release name already says cube; 63 characters at most. */}}
{{- define "cube.fullname" -}}
{{- if contains "cube" .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-cube" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "cube.labels" -}}
app.kubernetes.io/name: cube
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
cube.dict: {{ .Values.dict.name }}
{{- end -}}

{{- define "cube.selector" -}}
app.kubernetes.io/name: cube
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The StatefulSet (and its headless Service) of shard .shard */}}
{{- define "cube.shardName" -}}
{{- printf "%s-shard-%d" (include "cube.fullname" .root) (int .shard) -}}
{{- end -}}

{{/* The stable DNS name of replica .replica of shard .shard */}}
{{- define "cube.replicaHost" -}}
{{- $shard := include "cube.shardName" . -}}
{{- printf "%s-%d.%s.%s.svc.cluster.local" $shard (int .replica) $shard .root.Release.Namespace -}}
{{- end -}}

{{- define "cube.transferName" -}}
{{- printf "%s-transfer" (include "cube.fullname" .) -}}
{{- end -}}

{{- define "cube.transferHost" -}}
{{- printf "%s.%s.svc.cluster.local" (include "cube.transferName" .) .Release.Namespace -}}
{{- end -}}

{{- define "cube.secretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-tokens" (include "cube.fullname" .)) -}}
{{- end -}}

{{/* repository:tag, or repository@digest when a digest is given (reproducible pulls) */}}
{{- define "cube.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}

{{/* A token from the Secret, as an env entry */}}
{{- define "cube.tokenEnv" -}}
- name: {{ .env }}
  valueFrom:
    secretKeyRef:
      name: {{ include "cube.secretName" .root }}
      key: {{ .key }}
{{- end -}}

{{- define "cube.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "cube.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: [ALL]
{{- end -}}
