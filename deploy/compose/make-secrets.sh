#!/bin/sh
# Writes the secrets compose.yaml mounts (./secrets beside this script, files mode 0600):
#   cluster_secret    the proxy signs media hashes with it; encoders check them
#   api_keys          one client key per line, `KEY TENANT` (add lines for more clients)
#   redis_password    the Redis ACL user `epd`'s password (the roles read it)
#   redis_users.acl   Redis's ACL: `epd` limited to the epd:* keys and channels (plus reading
#                     a cluster's slot map), its password stored only as a SHA-256; `admin`
#                     for forming a Redis Cluster (compose.redis-cluster.yaml); unauthenticated
#                     clients may only PING
#   redis_admin_password  the ACL user `admin`'s password
# With --tls it also makes a CA and certificates for compose.tls.yaml (openssl).
# Existing files are kept: delete one to make it again.
set -eu
cd "$(dirname "$0")"
umask 077
mkdir -p secrets
cd secrets
random() { openssl rand -hex 32; }
[ -f cluster_secret ] || random > cluster_secret
[ -f api_keys ] || printf '%s default\n' "$(random)" > api_keys
[ -f redis_password ] || random > redis_password
[ -f redis_admin_password ] || random > redis_admin_password
if [ ! -f redis_users.acl ]; then
    sha() { tr -d '\n' < "$1" | openssl dgst -sha256 -r | cut -d' ' -f1; }
    {
        echo "user default on nopass -@all +ping"
        echo "user epd on #$(sha redis_password) ~epd:* &epd:* +@all -@dangerous +info" \
            "+cluster|slots +cluster|shards +cluster|info"
        echo "user admin on #$(sha redis_admin_password) ~* &* +@all"
    } > redis_users.acl
fi
if [ "${1:-}" = "--tls" ] && [ ! -f ca.crt ]; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 \
        -subj /CN=epd-cluster-ca -keyout ca.key -out ca.crt 2>/dev/null
    for name in proxy epd-worker; do
        openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$name" \
            -keyout "$name.key" -out "$name.csr" 2>/dev/null
        printf 'subjectAltName=DNS:%s,DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' \
            "$name" > "$name.ext"
        openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
            -extfile "$name.ext" -out "$name.crt" 2>/dev/null
        rm -f "$name.csr" "$name.ext"
    done
fi
echo "secrets in $(pwd); the API key(s): $(cut -d' ' -f1 api_keys | tr '\n' ' ')"
