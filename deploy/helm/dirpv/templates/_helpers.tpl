{{/*
Labels shared by every object. Names are fixed (not prefixed with the release): the CSIDriver
dirpv.io is cluster-wide, so there is one dirpv per cluster. The helm.sh/chart and managed-by
labels are the only ones deploy/base does not have.
*/}}
{{- define "dirpv.labels" -}}
app.kubernetes.io/name: dirpv
app.kubernetes.io/part-of: dirpv
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "dirpv.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if eq $tag "latest" -}}
{{- fail "image.tag: latest refused; name a version (a node keeps running whatever it already has under a reused tag)" -}}
{{- end -}}
{{ .Values.image.repository }}:{{ $tag }}
{{- end -}}

{{/*
dirpv.localBasePaths: the distinct basePaths of local classes, .Values.basePath first, then
node.allowedBasePaths, as a JSON list. The node plugin mounts each at the same path as on the
host and allows local volumes at or beneath them only (--allowed-base-paths).
*/}}
{{- define "dirpv.localBasePaths" -}}
{{- $paths := list .Values.basePath -}}
{{- range .Values.storageClasses -}}
{{- if eq (.backend | default "local") "local" -}}
{{- $paths = append $paths (.basePath | default $.Values.basePath) -}}
{{- end -}}
{{- end -}}
{{- range .Values.node.allowedBasePaths -}}
{{- $paths = append $paths . -}}
{{- end -}}
{{- $paths | uniq | toJson -}}
{{- end -}}

{{/*
dirpv.storageClass renders one StorageClass from a dict with keys root (the chart's top
context) and class (a storageClasses or nfs.exports entry, with backend set).
*/}}
{{- define "dirpv.storageClass" -}}
{{- $root := .root -}}
{{- $c := .class -}}
{{- if not $c.name }}{{ fail "every storage class needs a name" }}{{ end -}}
{{- $local := eq $c.backend "local" -}}
{{- if and (not $local) (ne $c.backend "nfs") -}}
{{- fail (printf "storage class %s: backend %q, want local or nfs" $c.name $c.backend) -}}
{{- end -}}
{{- $binding := $c.volumeBindingMode | default (ternary "WaitForFirstConsumer" "Immediate" $local) -}}
{{- if and $local (ne $binding "WaitForFirstConsumer") -}}
{{- fail (printf "storage class %s: a local class needs volumeBindingMode WaitForFirstConsumer (the directory is created on the pod's node)" $c.name) -}}
{{- end -}}
{{- if and (not $local) (not $root.Values.controller.enabled) -}}
{{- fail (printf "storage class %s: an nfs class needs controller.enabled (the controller provisions nfs classes)" $c.name) -}}
{{- end -}}
{{- if and (not $local) (or (not $c.server) (not $c.share)) -}}
{{- fail (printf "storage class %s: an nfs class needs server and share" $c.name) -}}
{{- end -}}
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: {{ $c.name }}
  labels:
    {{- include "dirpv.labels" $root | nindent 4 }}
  {{- if $c.default }}
  annotations:
    storageclass.kubernetes.io/is-default-class: "true"
  {{- end }}
provisioner: dirpv.io
parameters:
  backend: {{ $c.backend }}
  {{- if $local }}
  basePath: {{ $c.basePath | default $root.Values.basePath | quote }}
  {{- else }}
  server: {{ $c.server | quote }}
  share: {{ $c.share | quote }}
  {{- end }}
  {{- range $k := list "pathPattern" "onDelete" "mode" "uid" "gid" "capacityEnforcement" }}
  {{- if hasKey $c $k }}
  {{ $k }}: {{ index $c $k | toString | quote }}
  {{- end }}
  {{- end }}
reclaimPolicy: {{ $c.reclaimPolicy | default "Delete" }}
volumeBindingMode: {{ $binding }}
allowVolumeExpansion: {{ ternary $c.allowVolumeExpansion true (hasKey $c "allowVolumeExpansion") }}
{{- with $c.mountOptions }}
mountOptions:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
