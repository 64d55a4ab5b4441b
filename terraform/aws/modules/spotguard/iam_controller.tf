# The controller: launches and terminates only instances tagged spotguard:managed=true, passes
# only the agent roles, reads the fleet queue and the image bucket (gc deletes chunks).
data "aws_iam_policy_document" "controller_assume" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }

  dynamic "statement" {
    for_each = length(var.controller_trusted_principal_arns) > 0 ? [1] : []

    content {
      actions = ["sts:AssumeRole"]

      principals {
        type        = "AWS"
        identifiers = var.controller_trusted_principal_arns
      }
    }
  }
}

locals {
  ec2_arn = "arn:${local.partition}:ec2:${local.region}:${local.account}"
}

data "aws_iam_policy_document" "controller" {
  # New instances and their volumes must carry spotguard:managed=true from the start.
  statement {
    sid     = "RunOnlyTaggedInstances"
    actions = ["ec2:RunInstances"]
    resources = [
      "${local.ec2_arn}:instance/*",
      "${local.ec2_arn}:volume/*",
    ]

    condition {
      test     = "StringEquals"
      variable = "aws:RequestTag/${local.spotguard.tag_managed}"
      values   = ["true"]
    }
  }

  # The other resources RunInstances touches: only spotguard's launch templates.
  statement {
    sid     = "RunFromSpotguardTemplates"
    actions = ["ec2:RunInstances"]
    resources = concat(
      [for lt in aws_launch_template.job : lt.arn],
      [
        "arn:${local.partition}:ec2:${local.region}::image/*",
        "${local.ec2_arn}:subnet/*",
        "${local.ec2_arn}:network-interface/*",
        "${local.ec2_arn}:security-group/*",
        "${local.ec2_arn}:key-pair/*",
        "${local.ec2_arn}:spot-instances-request/*",
      ],
    )
  }

  statement {
    sid     = "TagOnlyAtLaunch"
    actions = ["ec2:CreateTags"]
    resources = [
      "${local.ec2_arn}:instance/*",
      "${local.ec2_arn}:volume/*",
      "${local.ec2_arn}:network-interface/*",
      "${local.ec2_arn}:spot-instances-request/*",
    ]

    condition {
      test     = "StringEquals"
      variable = "ec2:CreateAction"
      values   = ["RunInstances"]
    }
  }

  statement {
    sid       = "TerminateOnlyManaged"
    actions   = ["ec2:TerminateInstances"]
    resources = ["${local.ec2_arn}:instance/*"]

    condition {
      test     = "StringEquals"
      variable = "ec2:ResourceTag/${local.spotguard.tag_managed}"
      values   = ["true"]
    }
  }

  statement {
    sid       = "PassOnlyAgentRoles"
    actions   = ["iam:PassRole"]
    resources = [for role in aws_iam_role.agent : role.arn]

    condition {
      test     = "StringEquals"
      variable = "iam:PassedToService"
      values   = ["ec2.amazonaws.com"]
    }
  }

  # Describe actions support no resource-level permissions; "*" is the only resource AWS accepts.
  statement {
    sid = "ReadCatalogAndState"
    actions = [
      "ec2:DescribeAvailabilityZones",
      "ec2:DescribeImages",
      "ec2:DescribeInstanceStatus",
      "ec2:DescribeInstanceTypeOfferings",
      "ec2:DescribeInstanceTypes",
      "ec2:DescribeInstances",
      "ec2:DescribeLaunchTemplateVersions",
      "ec2:DescribeLaunchTemplates",
      "ec2:DescribeSpotPriceHistory",
      "ec2:DescribeSubnets",
    ]
    resources = ["*"]
  }

  statement {
    sid = "ConsumeFleetEvents"
    actions = [
      "sqs:ReceiveMessage",
      "sqs:DeleteMessage",
      "sqs:ChangeMessageVisibility",
      "sqs:GetQueueAttributes",
      "sqs:GetQueueUrl",
    ]
    resources = [aws_sqs_queue.events.arn]
  }

  statement {
    sid       = "ListImages"
    actions   = ["s3:ListBucket"]
    resources = [aws_s3_bucket.images.arn]
  }

  statement {
    sid       = "ReadAndCollectImages"
    actions   = ["s3:GetObject", "s3:DeleteObject"]
    resources = ["${aws_s3_bucket.images.arn}/*"]
  }

  statement {
    sid       = "DecryptImagesAndEvents"
    actions   = ["kms:Decrypt"]
    resources = [aws_kms_key.this.arn]
  }
}

resource "aws_iam_policy" "controller" {
  name        = "${var.name}-controller"
  description = "spotguard controller: relaunch tagged GPU instances, read fleet events and images"
  policy      = data.aws_iam_policy_document.controller.json
  tags        = local.tags
}

resource "aws_iam_role" "controller" {
  name                 = "${var.name}-controller"
  description          = "spotguard controller"
  assume_role_policy   = data.aws_iam_policy_document.controller_assume.json
  max_session_duration = 3600
  tags                 = local.tags
}

resource "aws_iam_role_policy_attachment" "controller" {
  role       = aws_iam_role.controller.name
  policy_arn = aws_iam_policy.controller.arn
}

resource "aws_iam_instance_profile" "controller" {
  name = "${var.name}-controller"
  role = aws_iam_role.controller.name
  tags = local.tags
}
