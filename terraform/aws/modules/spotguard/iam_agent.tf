# Agents: one role per job, tagged spotguard:job=<job>. A role's tags are principal tags of its
# sessions, so the one shared policy below names the job's prefix as
# ${aws:PrincipalTag/spotguard:job}: each instance reaches only <bucket>/<its job>/.
# (Instance tags do not reach IAM: an instance profile session carries the role's tags only,
# which is why the role, not the instance, holds the job name.)
data "aws_iam_policy_document" "ec2_assume" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "agent" {
  statement {
    sid       = "ListOwnJobPrefix"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.images.arn]

    condition {
      test     = "StringLike"
      variable = "s3:prefix"
      values   = ["$${aws:PrincipalTag/${local.spotguard.tag_job}}/*"]
    }
  }

  statement {
    sid = "ReadWriteOwnJobImages"
    actions = [
      "s3:GetObject",
      "s3:PutObject",
      "s3:AbortMultipartUpload",
      "s3:ListMultipartUploadParts",
    ]
    resources = ["${aws_s3_bucket.images.arn}/$${aws:PrincipalTag/${local.spotguard.tag_job}}/*"]
  }

  statement {
    sid       = "UseImageKeyThroughS3"
    actions   = ["kms:GenerateDataKey", "kms:Decrypt"]
    resources = [aws_kms_key.this.arn]

    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${local.region}.amazonaws.com"]
    }
  }

  # EC2 Describe* actions support no resource-level permissions: "*" is the only resource AWS
  # accepts. Read-only; the agent reads its own instance's facts (type, zone, tags).
  statement {
    sid       = "DescribeOwnInstance"
    actions   = ["ec2:DescribeInstances", "ec2:DescribeTags"]
    resources = ["*"]
  }
}

resource "aws_iam_policy" "agent" {
  name        = "${var.name}-agent"
  description = "spotguard agent: its own job's image prefix (from the role's spotguard:job tag), describe its instance"
  policy      = data.aws_iam_policy_document.agent.json
  tags        = local.tags
}

resource "aws_iam_role" "agent" {
  for_each = var.jobs

  name                 = local.job_slug[each.key]
  description          = "spotguard agent of job ${each.key}"
  assume_role_policy   = data.aws_iam_policy_document.ec2_assume.json
  max_session_duration = 3600
  tags                 = merge(local.tags, { "${local.spotguard.tag_job}" = each.key })
}

resource "aws_iam_role_policy_attachment" "agent" {
  for_each = var.jobs

  role       = aws_iam_role.agent[each.key].name
  policy_arn = aws_iam_policy.agent.arn
}

# The job's own image keys (keys.tf), fetched at boot by `spotguard fetch-keys`: one policy per
# role naming exactly its job's secret and parameter, so no role can read another job's key.
# kms:Decrypt only through Secrets Manager and only for that secret (its encryption context).
data "aws_iam_policy_document" "agent_keys" {
  for_each = var.jobs

  statement {
    sid       = "ReadOwnJobSigningKey"
    actions   = ["secretsmanager:GetSecretValue"]
    resources = [local.job_signing_secret_arn[each.key]]
  }

  statement {
    sid       = "ReadOwnJobVerifyKey"
    actions   = ["ssm:GetParameter"]
    resources = [aws_ssm_parameter.image_verify_key[each.key].arn]
  }

  statement {
    sid       = "DecryptOwnJobSigningKey"
    actions   = ["kms:Decrypt"]
    resources = [aws_kms_key.this.arn]

    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["secretsmanager.${local.region}.amazonaws.com"]
    }

    condition {
      test     = "StringEquals"
      variable = "kms:EncryptionContext:SecretARN"
      values   = [local.job_signing_secret_arn[each.key]]
    }
  }
}

resource "aws_iam_role_policy" "agent_keys" {
  for_each = var.jobs

  name   = "image-keys"
  role   = aws_iam_role.agent[each.key].id
  policy = data.aws_iam_policy_document.agent_keys[each.key].json
}

resource "aws_iam_instance_profile" "agent" {
  for_each = var.jobs

  name = local.job_slug[each.key]
  role = aws_iam_role.agent[each.key].name
  tags = merge(local.tags, { "${local.spotguard.tag_job}" = each.key })
}
