# The fleet's image signing key (docs/security.md, "Delivering the keys"). Agents sign every
# image with the private key; every restoring host and the controller trust the public key, so
# restore refuses unsigned, altered, mixed or rolled-back images by default.
#
# By default Terraform generates an Ed25519 pair: the private key is then also in the Terraform
# state (keep the state encrypted and access-controlled, as for any secret Terraform manages).
# To keep it out of the state, generate it elsewhere (`spotguard images keygen fleet.key`), put
# it in a secret yourself and set image_signing_key_secret_arn and image_verify_key.
# VMs never receive key material in user-data: the first-boot config and each assignment name
# the secret and the parameter, and `spotguard fetch-keys` (ExecStartPre of the agent unit)
# reads them with the instance role.
locals {
  generate_signing_key = var.image_signing_key_secret_arn == null
  signing_key_secret_arn = (
    local.generate_signing_key ? aws_secretsmanager_secret.image_signing[0].arn : var.image_signing_key_secret_arn
  )
  image_verify_key   = local.generate_signing_key ? trimspace(tls_private_key.image_signing[0].public_key_openssh) : var.image_verify_key
  signing_key_source = "aws-secretsmanager:${local.signing_key_secret_arn}"
  verify_key_source  = "aws-ssm:${aws_ssm_parameter.image_verify_key.arn}"
}

resource "tls_private_key" "image_signing" {
  count = local.generate_signing_key ? 1 : 0

  algorithm = "ED25519"
}

resource "aws_secretsmanager_secret" "image_signing" {
  #checkov:skip=CKV2_AWS_57:An image signing key cannot be rotated by a Lambda alone: hosts must trust the new public key before agents sign with it. Rotate by adding the new public key to image_verify_key, then replacing the secret (docs/security.md).
  count = local.generate_signing_key ? 1 : 0

  name                    = "${var.name}/image-signing-key"
  description             = "${var.name}: Ed25519 key the agents sign checkpoint images with"
  kms_key_id              = aws_kms_key.this.arn
  recovery_window_in_days = 7
  tags                    = local.tags
}

resource "aws_secretsmanager_secret_version" "image_signing" {
  count = local.generate_signing_key ? 1 : 0

  secret_id     = aws_secretsmanager_secret.image_signing[0].id
  secret_string = tls_private_key.image_signing[0].private_key_openssh
}

# The public key is not secret: a plain parameter every agent role may read.
resource "aws_ssm_parameter" "image_verify_key" {
  #checkov:skip=CKV2_AWS_34:This parameter holds a public key (not secret); its integrity is what matters, and only this module writes it.
  name        = "/${var.name}/image-verify-key"
  description = "${var.name}: Ed25519 public key(s) restoring hosts verify checkpoint images with"
  type        = "String"
  value       = local.image_verify_key
  tags        = local.tags
}
