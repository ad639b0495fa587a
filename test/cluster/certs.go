package cluster

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	certutil "k8s.io/client-go/util/cert"
	"k8s.io/client-go/util/keyutil"
)

// pki holds the cluster CA and writes leaf certificates signed by it. ECDSA P-256 keeps key
// generation in the milliseconds; only the service-account key is RSA, the most widely
// accepted signing key type for service-account tokens.
type pki struct {
	dir    string
	caCert *x509.Certificate
	caKey  crypto.Signer
}

func (p *pki) path(name string) string { return filepath.Join(p.dir, name) }

func newPKI(dir string) (*pki, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create pki dir: %w", err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate CA key: %w", err)
	}
	cert, err := certutil.NewSelfSignedCACert(certutil.Config{CommonName: "dirpv-test-ca", NotBefore: time.Now().Add(-time.Hour)}, key)
	if err != nil {
		return nil, fmt.Errorf("create CA cert: %w", err)
	}
	p := &pki{dir: dir, caCert: cert, caKey: key}
	if err := writePEM(p.path("ca.crt"), "CERTIFICATE", cert.Raw); err != nil {
		return nil, err
	}
	if err := writeKey(p.path("ca.key"), key); err != nil {
		return nil, err
	}
	return p, nil
}

// leaf writes <name>.crt and <name>.key. Client certs carry the identity in CN (user) and O
// (groups), which is how the apiserver's x509 authenticator maps them.
func (p *pki) leaf(name, cn string, orgs []string, dns []string, ips []net.IP, server, client bool) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("generate key %s: %w", name, err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return fmt.Errorf("serial: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: cn, Organization: orgs},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		DNSNames:     dns,
		IPAddresses:  ips,
	}
	if server {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
	}
	if client {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageClientAuth)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.caCert, key.Public(), p.caKey)
	if err != nil {
		return fmt.Errorf("sign %s: %w", name, err)
	}
	if err := writePEM(p.path(name+".crt"), "CERTIFICATE", der); err != nil {
		return err
	}
	return writeKey(p.path(name+".key"), key)
}

// serviceAccountKey writes sa.key (PKCS#1 RSA) and sa.pub for token signing and verification.
func (p *pki) serviceAccountKey() error {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return fmt.Errorf("generate service-account key: %w", err)
	}
	if err := writePEM(p.path("sa.key"), "RSA PRIVATE KEY", x509.MarshalPKCS1PrivateKey(key)); err != nil {
		return err
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return fmt.Errorf("marshal service-account public key: %w", err)
	}
	return writePEM(p.path("sa.pub"), "PUBLIC KEY", pub)
}

// kubeconfig writes a kubeconfig for the client cert <certName> with embedded data, so the file
// stays valid on its own (e.g. copied elsewhere by a developer).
func (p *pki) kubeconfig(path, server, certName string) error {
	ca, err := os.ReadFile(p.path("ca.crt"))
	if err != nil {
		return fmt.Errorf("read CA: %w", err)
	}
	crt, err := os.ReadFile(p.path(certName + ".crt"))
	if err != nil {
		return fmt.Errorf("read %s cert: %w", certName, err)
	}
	key, err := os.ReadFile(p.path(certName + ".key"))
	if err != nil {
		return fmt.Errorf("read %s key: %w", certName, err)
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["dirpv"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: ca}
	cfg.AuthInfos[certName] = &clientcmdapi.AuthInfo{ClientCertificateData: crt, ClientKeyData: key}
	cfg.Contexts["dirpv"] = &clientcmdapi.Context{Cluster: "dirpv", AuthInfo: certName}
	cfg.CurrentContext = "dirpv"
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		return fmt.Errorf("write kubeconfig %s: %w", path, err)
	}
	return nil
}

func writeKey(path string, key *ecdsa.PrivateKey) error {
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return fmt.Errorf("marshal key %s: %w", path, err)
	}
	return writePEM(path, "EC PRIVATE KEY", der)
}

func writePEM(path, typ string, der []byte) error {
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// load reads the CA written by newPKI, for signing certificates after Start (node, kubelet).
func (p *pki) load() error {
	certs, err := certutil.CertsFromFile(p.path("ca.crt"))
	if err != nil {
		return fmt.Errorf("read CA cert: %w", err)
	}
	key, err := keyutil.PrivateKeyFromFile(p.path("ca.key"))
	if err != nil {
		return fmt.Errorf("read CA key: %w", err)
	}
	signer, ok := key.(crypto.Signer)
	if !ok {
		return fmt.Errorf("CA key in %s: %T is no signing key", p.dir, key)
	}
	p.caCert, p.caKey = certs[0], signer
	return nil
}
