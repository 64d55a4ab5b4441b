# The controller: launches only from spotguard's launch templates, with spotguard's machine
# image, into the given subnets and security groups, instances tagged spotguard:managed=true;
# passes only the agent roles (to EC2); terminates only managed instances; reads the fleet queue
# and the image bucket (gc deletes chunks); reads no image key (it holds the public keys only).
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

# The zone of each launch subnet: controller_config maps zones to them ([aws] aws_subnets).
data "aws_subnet" "launch" {
  for_each = toset(var.subnet_ids)

  id = each.key
}

locals {
  ec2_arn        = "arn:${local.partition}:ec2:${local.region}:${local.account}"
  template_arns  = [for lt in aws_launch_template.job : lt.arn]
  launch_subnets = length(var.subnet_ids) > 0 ? [for id in var.subnet_ids : "${local.ec2_arn}:subnet/${id}"] : ["${local.ec2_arn}:subnet/*"]
  launch_groups = (
    length(var.security_group_ids) > 0
    ? [for id in var.security_group_ids : "${local.ec2_arn}:security-group/${id}"]
    : ["${local.ec2_arn}:security-group/*"]
  )
  launch_key_pairs = var.key_name == null ? [] : ["${local.ec2_arn}:key-pair/${var.key_name}"]
}

data "aws_iam_policy_document" "controller" {
  # New instances and their volumes must carry spotguard:managed=true from the start, and come
  # from one of spotguard's launch templates (which name the job's instance profile).
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

    condition {
      test     = "ArnEquals"
      variable = "ec2:LaunchTemplate"
      values   = local.template_arns
    }
  }

  # The other resources RunInstances touches: spotguard's launch templates, its machine image
  # (var.ami_id, nobody's else), the given subnets, security groups and key pair.
  statement {
    sid     = "RunFromSpotguardTemplates"
    actions = ["ec2:RunInstances"]
    resources = concat(
      local.template_arns,
      ["arn:${local.partition}:ec2:${local.region}::image/${var.ami_id}"],
      local.launch_subnets,
      local.launch_groups,
      local.launch_key_pairs,
      [
        "${local.ec2_arn}:network-interface/*",
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

  # Only through S3 (images) and SQS (events): never the image keys' secrets.
  statement {
    sid       = "DecryptImagesAndEvents"
    actions   = ["kms:Decrypt"]
    resources = [aws_kms_key.this.arn]

    condition {
      test     = "StringEquals"
      variable = "kms:ViaService"
      values   = ["s3.${local.region}.amazonaws.com", "sqs.${local.region}.amazonaws.com"]
    }
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
