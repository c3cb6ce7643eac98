{{/* The chart's name: "cube", or nameOverride (in app.kubernetes.io/name, a selector label). */}}
{{- define "cube.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The prefix of every object's name: fullnameOverride, else <release>-<name> (the release name
alone when it already contains the name). A StatefulSet's name and a 10-character hash form
the controller-revision-hash label of its pods, at most 63 characters: so the longest
StatefulSet name, <fullname>-transfer or <fullname>-shard-<last shard>, may have 52. A longer
fullname is cut and ends with 5 characters of its hash instead (two long names stay apart).
*/}}
{{- define "cube.fullname" -}}
{{- $name := include "cube.name" . -}}
{{- $full := .Values.fullnameOverride -}}
{{- if not $full -}}
{{- $full = ternary .Release.Name (printf "%s-%s" .Release.Name $name) (contains $name .Release.Name) -}}
{{- /* a release named from a digit (1emb): <name>-<release>, Services need a letter first */ -}}
{{- if and (not (regexMatch "^[a-z]" $full)) (regexMatch "^[a-z]" $name) -}}
{{- $full = printf "%s-%s" $name .Release.Name -}}
{{- end -}}
{{- end -}}
{{- $suffix := max (len "-transfer") (len (printf "-shard-%d" (sub (int .Values.dict.shards) 1))) -}}
{{- $most := sub 52 $suffix | int -}}
{{- if gt (len $full) $most -}}
{{- $full = printf "%s-%s" (regexReplaceAll "[-.]+$" ($full | trunc (sub $most 6 | int)) "") (sha256sum $full | trunc 5) -}}
{{- end -}}
{{- $full -}}
{{- end -}}

{{/*
The lookup and lane ports of each worker of a server, as JSON {"grpc": [...], "lane": [...]}:
worker 0 on server.port and server.lanePort, each next one on the next port the pod does not
use otherwise (agent.port, the metrics ports, the control ports, the other kind's): so
`server.workers: 2` does not take the agent's 8001 (the servers get the lists as
--worker_ports and --tcp_ports, clients in cube.conf).
*/}}
{{- define "cube.workerPorts" -}}
{{- $v := .Values -}}
{{- $workers := int $v.server.workers -}}
{{- $taken := list (int $v.agent.port) (int $v.server.metricsPort) (int $v.agent.metricsPort) -}}
{{- range $i := until $workers }}{{ $taken = append $taken (add $v.server.controlPort $i | int) }}{{ end -}}
{{- $out := dict -}}
{{- range $kind := list "grpc" "lane" -}}
{{- $next := int (ternary $v.server.port $v.server.lanePort (eq $kind "grpc")) -}}
{{- if has $next $taken -}}
{{- fail (printf "server.%s %d is taken by another port of the shard pod (agent.port, server.metricsPort, server.controlPort + 0..workers-1, or the other kind's)" (ternary "port" "lanePort" (eq $kind "grpc")) $next) -}}
{{- end -}}
{{- $ports := list -}}
{{- range $i := until $workers -}}
{{- range $_ := until (len $taken) }}{{ if has $next $taken }}{{ $next = add1 $next | int }}{{ end }}{{ end -}}
{{- $ports = append $ports $next -}}
{{- $taken = append $taken $next -}}
{{- $next = add1 $next | int -}}
{{- end -}}
{{- $_ := set $out $kind $ports -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* A label value: at most 63 characters, alphanumeric at both ends. */}}
{{- define "cube.labelValue" -}}
{{- regexReplaceAll "[-_.]+$" (. | toString | trunc 63) "" | quote -}}
{{- end -}}

{{- define "cube.labels" -}}
app.kubernetes.io/name: {{ include "cube.name" . | quote }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/version: {{ include "cube.labelValue" .Chart.AppVersion }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ include "cube.labelValue" (printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_") }}
cube.dict: {{ include "cube.labelValue" .Values.dict.name }}
{{- end -}}

{{- define "cube.selector" -}}
app.kubernetes.io/name: {{ include "cube.name" . | quote }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
{{- end -}}

{{/* The StatefulSet (and its headless Service) of shard .shard */}}
{{- define "cube.shardName" -}}
{{- printf "%s-shard-%d" (include "cube.fullname" .root) (int .shard) -}}
{{- end -}}

{{- define "cube.domain" -}}
{{- printf "%s.svc.%s" .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/* The stable DNS name of replica .replica of shard .shard */}}
{{- define "cube.replicaHost" -}}
{{- $shard := include "cube.shardName" . -}}
{{- printf "%s-%d.%s.%s" $shard (int .replica) $shard (include "cube.domain" .root) -}}
{{- end -}}

{{- define "cube.transferName" -}}
{{- printf "%s-transfer" (include "cube.fullname" .) -}}
{{- end -}}

{{- define "cube.transferHost" -}}
{{- printf "%s.%s" (include "cube.transferName" .) (include "cube.domain" .) -}}
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

{{/* Service accounts: the shard pods' (.component "shard") and the transfer's */}}
{{- define "cube.serviceAccountName" -}}
{{- $account := ternary .root.Values.transfer.serviceAccount .root.Values.serviceAccount (eq .component "transfer") -}}
{{- $made := ternary (include "cube.transferName" .root) (include "cube.fullname" .root) (eq .component "transfer") -}}
{{- $account.name | default (ternary $made "default" $account.create) -}}
{{- end -}}

{{/* What every pod spec of the chart starts with */}}
{{- define "cube.podBasics" -}}
serviceAccountName: {{ include "cube.serviceAccountName" . }}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .root.Values.image.pullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* TLS: where the certificate is mounted, the Secret that holds it */}}
{{- define "cube.tlsDir" -}}/etc/cube-tls{{- end -}}

{{- define "cube.tlsSecretName" -}}
{{- $tls := .Values.tls -}}
{{- if and $tls.existingSecret $tls.certManager.enabled -}}
{{- fail "tls: set tls.existingSecret or tls.certManager.enabled, not both" -}}
{{- else if $tls.existingSecret -}}
{{- $tls.existingSecret -}}
{{- else if $tls.certManager.enabled -}}
{{- printf "%s-tls" (include "cube.fullname" .) -}}
{{- else -}}
{{- fail "tls.enabled: give the certificate, tls.existingSecret (a Secret with tls.crt, tls.key and ca.crt) or tls.certManager.enabled with tls.certManager.issuerRef" -}}
{{- end -}}
{{- end -}}

{{/* The TLS volume of a pod (.items: only these keys) */}}
{{- define "cube.tlsVolume" -}}
- name: tls
  secret:
    secretName: {{ include "cube.tlsSecretName" .root }}
    defaultMode: 0440
    {{- with .items }}
    items:
      {{- range . }}
      - {key: {{ . }}, path: {{ . }}}
      {{- end }}
    {{- end }}
{{- end -}}

{{/* The lookup scheme of the transfer's file server: https with TLS */}}
{{- define "cube.fileScheme" -}}
{{- ternary "https" "http" .Values.tls.enabled -}}
{{- end -}}

{{/* A probe's timing fields (the values), under its action (the chart's) */}}
{{- define "cube.probeTiming" -}}
{{- range $key, $value := . }}
{{ $key }}: {{ $value }}
{{- end }}
{{- end -}}

{{/*
A pod-template annotation's checksum of the tokens (.keys of the tokens Secret) a pod's
processes read from their environment, which a changed Secret does not reach: a change rolls
the pods. The chart's own Secret changes through auth.agentToken, apiToken, controlToken (the
generated ones are kept by upgrades, and not hashed); a Secret of yours (auth.existingSecret)
is hashed as `helm upgrade` finds it in the cluster (`helm template`: not at all). The TLS
Secret has no checksum: the processes read renewed certificates live (docs/DEPLOY.md).
*/}}
{{- define "cube.tokensChecksum" -}}
{{- $auth := .root.Values.auth -}}
{{- $given := dict "agent-token" $auth.agentToken "api-token" $auth.apiToken "control-token" $auth.controlToken -}}
{{- $found := dict -}}
{{- with $auth.existingSecret -}}
{{- $found = (lookup "v1" "Secret" $.root.Release.Namespace .).data | default dict -}}
{{- end -}}
{{- $hashed := dict "secret" $auth.existingSecret -}}
{{- range $key := .keys -}}
{{- $_ := set $hashed $key (ternary (get $found $key) (get $given $key | toString) (not (empty $auth.existingSecret))) -}}
{{- end -}}
{{- toJson $hashed | sha256sum | trunc 16 -}}
{{- end -}}

{{/* The same for a Secret of yours that becomes a container's environment (.name) */}}
{{- define "cube.secretChecksum" -}}
{{- $data := (lookup "v1" "Secret" .root.Release.Namespace .name).data | default dict -}}
{{- toJson (dict "secret" .name "data" $data) | sha256sum | trunc 16 -}}
{{- end -}}
