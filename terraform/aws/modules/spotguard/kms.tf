# One customer-managed key encrypts the image bucket and the fleet event queues.
data "aws_iam_policy_document" "kms" {
  #checkov:skip=CKV_AWS_111:This is a KMS key policy, not an identity policy: Resource "*" means this one key. Write use is limited by the principals and the SourceArn condition.
  #checkov:skip=CKV_AWS_356:In a key policy "*" is the only valid resource and names the key itself.
  #checkov:skip=CKV_AWS_109:The account root statement is AWS's default key policy; without it the key could become unmanageable. Who may administer it is decided by the account's IAM policies.
  # The account's IAM policies decide who else may use the key (AWS's default key policy):
  # without this statement the key could become unmanageable.
  statement {
    sid       = "AccountAdministers"
    actions   = ["kms:*"]
    resources = ["*"]

    principals {
      type        = "AWS"
      identifiers = ["arn:${local.partition}:iam::${local.account}:root"]
    }
  }

  # EventBridge writes into the encrypted queue: it needs a data key, for our rules only.
  statement {
    sid       = "EventBridgeToQueue"
    actions   = ["kms:GenerateDataKey", "kms:Decrypt"]
    resources = ["*"]

    principals {
      type        = "Service"
      identifiers = ["events.amazonaws.com"]
    }

    condition {
      test     = "ArnEquals"
      variable = "aws:SourceArn"
      values   = local.event_rule_arns
    }
  }
}

resource "aws_kms_key" "this" {
  description             = "${var.name}: checkpoint images and fleet interruption events"
  enable_key_rotation     = true
  deletion_window_in_days = var.kms_deletion_window_days
  policy                  = data.aws_iam_policy_document.kms.json
  tags                    = local.tags
}

resource "aws_kms_alias" "this" {
  name          = "alias/${var.name}"
  target_key_id = aws_kms_key.this.key_id
}
